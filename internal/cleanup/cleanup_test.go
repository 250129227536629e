package cleanup

import (
	"errors"
	"testing"
)

func TestRunReverseAndRelease(t *testing.T) {
	var order []int
	var s Stack
	s.Add(func() error { order = append(order, 1); return nil })
	s.Add(func() error { order = append(order, 2); return errors.New("boom") })
	if err := s.Run(); err == nil || err.Error() != "boom" {
		t.Fatalf("Run error = %v, want boom", err)
	}
	if len(order) != 2 || order[0] != 2 || order[1] != 1 {
		t.Fatalf("order = %v, want [2 1]", order)
	}
	s.Add(func() error { t.Fatal("released step ran"); return nil })
	s.Release()
	if err := s.Run(); err != nil {
		t.Fatal(err)
	}
}
