//go:build tools

// Package internal pins the modules ember builds on, so go.mod lists them before code uses them.
package internal

import (
	_ "connectrpc.com/connect"
	_ "github.com/creack/pty"
	_ "github.com/fsnotify/fsnotify"
	_ "github.com/minio/minio-go/v7"
	_ "github.com/opencontainers/runtime-spec/specs-go"
	_ "github.com/spf13/cobra"
	_ "github.com/vishvananda/netlink"
	_ "github.com/vishvananda/netns"
	_ "go.etcd.io/bbolt"
	_ "golang.org/x/sys/unix"
	_ "golang.org/x/term"
	_ "google.golang.org/protobuf/proto"
)
