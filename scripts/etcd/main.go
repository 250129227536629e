// Command etcd is etcd's own server main, built from the pinned go.etcd.io/etcd/server/v3
// module. It exists only because `go install go.etcd.io/etcd/server/v3@V` refuses a module
// whose go.mod has replace directives; scripts/setup.sh builds it into .cache/bin/etcd.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
