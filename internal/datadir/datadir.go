// Package datadir names the directories under ember's data directory (--data-dir) that more
// than one package writes or reads.
package datadir

import "path/filepath"

// Builds holds the template build records and logs (<id>.json, <id>.log).
func Builds(dataDir string) string { return filepath.Join(dataDir, "builds") }

// BuildFiles holds the uploaded COPY tarballs of step builds, by hash.
func BuildFiles(dataDir string) string { return filepath.Join(dataDir, "build-files") }

// Imports holds the image archives templates are built from (archive:NAME).
func Imports(dataDir string) string { return filepath.Join(dataDir, "imports") }

// Layers holds the captured layers of step builds (step-KEY) and forks.
func Layers(dataDir string) string { return filepath.Join(dataDir, "layers") }

// Templates holds a directory per template: its rootfs and image of each build.
func Templates(dataDir string) string { return filepath.Join(dataDir, "templates") }

// Sandboxes holds a directory per sandbox: its instances' state and images.
func Sandboxes(dataDir string) string { return filepath.Join(dataDir, "sandboxes") }
