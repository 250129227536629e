package e2e

import (
	"fmt"
	"testing"
)

// TestManyCommandsInOneSandbox runs commands back to back through the sandbox plane, as SDK
// code does; every stream must end with the command's result.
func TestManyCommandsInOneSandbox(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	for i := 0; i < 100; i++ {
		user := ""
		if i%2 == 0 {
			user = "root"
		}
		r, err := d.tryRun(s, fmt.Sprintf("echo run-%d; whoami", i), user)
		if err != nil || r.stdout == "" || r.exitCode != 0 {
			t.Fatalf("command %d: %+v %v", i, r, err)
		}
	}
}
