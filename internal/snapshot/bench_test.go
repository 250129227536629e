package snapshot_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
	"github.com/ember-sandbox/ember/internal/snapshot/s3"
	"github.com/ember-sandbox/ember/internal/snapshot/s3/s3test"
)

// BenchmarkStore measures Save, Load and a second Save after 1 MiB changed, on a 256 MiB
// checkpoint-like directory of incompressible data:
//
//	go test ./internal/snapshot -run '^$' -bench Store -benchtime 3x
//
// With EMBER_BENCH_DROP_CACHES=1 (root) the page cache is dropped before each Load, so chunks
// come from disk rather than memory. EMBER_BENCH_CHUNK_SIZE (bytes) overrides the chunk size.
func BenchmarkStore(b *testing.B) {
	const size = 256 << 20
	src := b.TempDir()
	mem := make([]byte, size-8<<20)
	fillRandom(mem, 1)
	meta := make([]byte, 8<<20)
	fillRandom(meta, 2)
	writeFile(b, filepath.Join(src, "pages.img"), mem)
	writeFile(b, filepath.Join(src, "checkpoint.img"), meta)
	writeFile(b, filepath.Join(src, "config.json"), []byte(`{"id":"bench"}`))

	// Each factory call gives an empty backend: a new directory, or a new prefix on one server.
	factories := map[string]func(b *testing.B) func() snapshot.Backend{
		"local": func(b *testing.B) func() snapshot.Backend {
			return func() snapshot.Backend {
				be, err := local.New(b.TempDir())
				if err != nil {
					b.Fatal(err)
				}
				return be
			}
		},
		"s3": func(b *testing.B) func() snapshot.Backend {
			cfg := s3test.Start(b)
			n := 0
			return func() snapshot.Backend {
				n++
				c := cfg
				c.Prefix = fmt.Sprintf("b%d/", n)
				be, err := s3.New(c)
				if err != nil {
					b.Fatal(err)
				}
				return be
			}
		},
	}
	for _, name := range []string{"local", "s3"} {
		b.Run(name, func(b *testing.B) {
			newBackend := factories[name](b)
			ctx := context.Background()
			s := snapshot.New(newBackend(), chunkOpt(b))
			b.Run("save", func(b *testing.B) {
				b.SetBytes(size)
				for b.Loop() {
					// A fresh backend each time, so every chunk is uploaded.
					fresh := snapshot.New(newBackend(), chunkOpt(b))
					n++
					if _, err := fresh.Save(ctx, fmt.Sprintf("s%d", n), src); err != nil {
						b.Fatal(err)
					}
				}
			})
			if _, err := s.Save(ctx, "base", src); err != nil {
				b.Fatal(err)
			}
			for _, lc := range []struct {
				name  string
				store *snapshot.Store
			}{{"load", s}, {"load-nosync", snapshot.New(s.Backend(), snapshot.WithoutLoadSync())}} {
				b.Run(lc.name, func(b *testing.B) {
					b.SetBytes(size)
					for b.Loop() {
						b.StopTimer()
						dest := filepath.Join(b.TempDir(), "out")
						dropCaches(b)
						b.StartTimer()
						if err := lc.store.Load(ctx, "base", dest); err != nil {
							b.Fatal(err)
						}
						b.StopTimer()
						os.RemoveAll(dest)
						b.StartTimer()
					}
				})
			}
			b.Run("resave-1MiB-changed", func(b *testing.B) {
				var uploaded, saves int64
				for b.Loop() {
					b.StopTimer()
					n++
					off := int64(100<<20 + 512<<10) // spans two 1 MiB chunks, or one 4 MiB chunk
					patch := make([]byte, 1<<20)
					fillRandom(patch, uint64(n)+100)
					f, err := os.OpenFile(filepath.Join(src, "pages.img"), os.O_WRONLY, 0)
					if err != nil {
						b.Fatal(err)
					}
					f.WriteAt(patch, off)
					f.Close()
					b.StartTimer()
					m, err := s.Save(ctx, fmt.Sprintf("r%d", n), src)
					if err != nil {
						b.Fatal(err)
					}
					uploaded += m.Transfer.UploadedBytes
					saves++
				}
				b.ReportMetric(float64(uploaded/saves), "uploaded-bytes/op")
			})
		})
	}
}

// n numbers snapshots and patches, so no two are alike across sub-benchmarks.
var n int

func chunkOpt(b *testing.B) snapshot.Option {
	v := os.Getenv("EMBER_BENCH_CHUNK_SIZE")
	if v == "" {
		return snapshot.WithChunkSize(snapshot.DefaultChunkSize)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		b.Fatalf("EMBER_BENCH_CHUNK_SIZE: %v", err)
	}
	return snapshot.WithChunkSize(n)
}

func dropCaches(b *testing.B) {
	if os.Getenv("EMBER_BENCH_DROP_CACHES") != "1" {
		return
	}
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
		b.Fatalf("drop caches: %v", err)
	}
}

func fillRandom(p []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, ^seed))
	for i := 0; i+8 <= len(p); i += 8 {
		v := r.Uint64()
		for k := range 8 {
			p[i+k] = byte(v >> (8 * k))
		}
	}
}

func writeFile(b *testing.B, p string, data []byte) {
	b.Helper()
	if err := os.WriteFile(p, data, 0o600); err != nil {
		b.Fatal(err)
	}
}
