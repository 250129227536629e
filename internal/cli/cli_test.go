package cli

import (
	"io"
	"os"
	"strings"
	"testing"
)

// captureStdout runs fn with os.Stdout redirected and returns what it printed.
func captureStdout(t *testing.T, fn func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stdout
	os.Stdout = w
	done := make(chan string)
	go func() { b, _ := io.ReadAll(r); done <- string(b) }()
	fn()
	os.Stdout = old
	w.Close()
	return <-done
}

// The API key in the environment must never appear in --help (it used to be the flag's
// default, which cobra prints).
func TestHelpDoesNotPrintTheAPIKey(t *testing.T) {
	t.Setenv("E2B_API_KEY", "e2b_00112233445566778899aabbccddeeff00112233")
	for _, args := range [][]string{{"--help"}, {"sandbox", "ls", "--help"}, {"serve", "--help"}} {
		out := captureStdout(t, func() { Main(args) })
		if strings.Contains(out, "00112233445566778899") {
			t.Fatalf("%v printed the API key:\n%s", args, out)
		}
		if !strings.Contains(out, "Usage") && !strings.Contains(out, "usage") {
			t.Fatalf("%v printed no help:\n%s", args, out)
		}
	}
}
