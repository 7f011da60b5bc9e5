// Command etcd is the upstream etcd server, built from the go.etcd.io/etcd/server/v3 module
// (the same entry point as etcd's own main.go) so its version is pinned in this go.mod.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
