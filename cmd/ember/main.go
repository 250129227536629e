// Command ember is the ember daemon (`ember serve`) and its command line client.
package main

import (
	"os"

	"github.com/ember-sandbox/ember/internal/cli"
)

func main() { os.Exit(cli.Main(os.Args[1:])) }
