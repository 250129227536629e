// Package datadir names every path under ember's data directory (--data-dir): the one place
// that says where each thing lives. Each package still owns what it keeps in its part (the
// sandbox Manager the sandbox directories, the template builder the templates, the driver its
// runsc root); nothing else joins a name onto the data directory.
//
// Every function takes the data directory and returns a path beneath it; none creates
// anything.
package datadir

import "path/filepath"

// Template builds (internal/template/build).

// Builds holds the template build records and logs (<id>.json, <id>.log).
func Builds(dataDir string) string { return filepath.Join(dataDir, "builds") }

// BuildFiles holds the uploaded COPY tarballs of step builds, by hash.
func BuildFiles(dataDir string) string { return filepath.Join(dataDir, "build-files") }

// Imports holds the image archives templates are built from (archive:NAME).
func Imports(dataDir string) string { return filepath.Join(dataDir, "imports") }

// Layers holds the image layers (the image store) and the captured layers of step builds
// (step-KEY); a step layer being captured is staged as .tmp-step-KEY.
func Layers(dataDir string) string { return filepath.Join(dataDir, "layers") }

// Templates holds a directory per template: its rootfs (rootfs-*, composed as rootfs-*.tmp),
// the build directories of its builds (build-*) and the image of each build.
func Templates(dataDir string) string { return filepath.Join(dataDir, "templates") }

// Sandboxes and what the sandbox Manager keeps beside them (internal/sandbox).

// Sandboxes holds a directory per sandbox: its instances' state (run-*), pause images
// (image-*), checkpoints and stage directories (.*).
func Sandboxes(dataDir string) string { return filepath.Join(dataDir, "sandboxes") }

// Sandbox is the directory of sandbox id.
func Sandbox(dataDir, id string) string { return filepath.Join(Sandboxes(dataDir), id) }

// Images holds checkpoint images not owned by one sandbox: snapshots (by snapshot id), fork
// images (fork-*) and images restored from the store for forks (in-*).
func Images(dataDir string) string { return filepath.Join(dataDir, "images") }

// Image is the image named name in Images.
func Image(dataDir, name string) string { return filepath.Join(Images(dataDir), name) }

// ForkLayers holds the read-only layers forks stack their children on.
func ForkLayers(dataDir string) string { return filepath.Join(dataDir, "forks") }

// Remote holds what was loaded from the snapshot store under another node's names: layers (by
// their encoded identity), images (images/<id>) and export stages (.export-*).
func Remote(dataDir string) string { return filepath.Join(dataDir, "remote") }

// RemoteImages holds the checkpoint images loaded from the snapshot store, by store id.
func RemoteImages(dataDir string) string { return filepath.Join(Remote(dataDir), "images") }

// Named is the path of a layer named by its path relative to the data directory (a layer
// identity of this node: internal/sandbox's layerid.go lists them).
func Named(dataDir, rel string) string { return filepath.Join(dataDir, filepath.FromSlash(rel)) }

// Pool is a directory of an earlier layout (the warm pool's instances): removed at start.
func Pool(dataDir string) string { return filepath.Join(dataDir, "pool") }

// The daemon's own files (internal/daemon).

// Runsc is the driver's runsc root (state files, control sockets, its namespace mounts).
func Runsc(dataDir string) string { return filepath.Join(dataDir, "runsc") }

// FailedLogs keeps the runsc logs of launches that failed (the driver's, beside Runsc).
func FailedLogs(dataDir string) string { return filepath.Join(dataDir, "logs", "failed") }

// DB is the metadata store (bbolt).
func DB(dataDir string) string { return filepath.Join(dataDir, "ember.db") }

// APIKey is the file holding the first API key, written once at set-up.
func APIKey(dataDir string) string { return filepath.Join(dataDir, "api-key") }

// SecretsKey is the key that seals secrets in the store.
func SecretsKey(dataDir string) string { return filepath.Join(dataDir, "secrets.key") }

// Cache is the default download cache (--cache-dir).
func Cache(dataDir string) string { return filepath.Join(dataDir, "cache") }

// TLS holds the local certificate authority and the daemon's certificate.
func TLS(dataDir string) string { return filepath.Join(dataDir, "tls") }

// Egress holds the egress proxy's certificate authority.
func Egress(dataDir string) string { return filepath.Join(dataDir, "egress") }

// EnvdStamps records which envd each built-in template was built with, by template name.
func EnvdStamps(dataDir string) string { return filepath.Join(dataDir, "envd-stamps") }

// ClusterLease keeps this node's etcd lease between restarts.
func ClusterLease(dataDir string) string { return filepath.Join(dataDir, "cluster-lease") }

// Snapshots is the local snapshot store (when no S3 store is configured).
func Snapshots(dataDir string) string { return filepath.Join(dataDir, "snapshots") }

// SnapshotKey is the key that signs snapshot manifests (when the cluster does not hold one).
func SnapshotKey(dataDir string) string { return filepath.Join(dataDir, "snapshot-key") }

// SnapshotCache caches chunks fetched from the snapshot store.
func SnapshotCache(dataDir string) string { return filepath.Join(dataDir, "snapshot-cache") }

// Volumes holds the volumes' data and the shared volumes' mount (Volumes/s3).
func Volumes(dataDir string) string { return filepath.Join(dataDir, "volumes") }
