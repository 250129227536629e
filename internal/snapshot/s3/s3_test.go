package s3_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/s3"
	"github.com/ember-sandbox/ember/internal/snapshot/s3/s3test"
	"github.com/ember-sandbox/ember/internal/snapshot/snapshottest"
)

// prefixed returns a factory giving each subtest an empty store on the one server, under its
// own key prefix.
func prefixed(cfg s3.Config) func(t *testing.T) snapshot.Backend {
	n := 0
	return func(t *testing.T) snapshot.Backend {
		n++
		c := cfg
		c.Prefix = fmt.Sprintf("t%03d/", n)
		b, err := s3.New(c)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
}

func TestConformance(t *testing.T) {
	snapshottest.Run(t, prefixed(s3test.Start(t)))
}

func TestTLS(t *testing.T) {
	cfg := s3test.StartTLS(t)
	ctx := context.Background()
	b, err := s3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Put(ctx, "hello", strings.NewReader("world"), 5); err != nil {
		t.Fatalf("Put over TLS with the server's CA: %v", err)
	}

	noCA := cfg
	noCA.CAFile = ""
	b, err = s3.New(noCA)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Exists(ctx, "hello"); err == nil {
		t.Error("Exists succeeded against an untrusted certificate")
	}
}

func TestServerErrors(t *testing.T) {
	cfg := s3test.Start(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		mutate func(c *s3.Config)
		want   error
	}{
		{"wrong secret", func(c *s3.Config) { c.SecretKey = "wrong" }, errdefs.ErrUnauthorized},
		{"missing bucket", func(c *s3.Config) { c.Bucket = "no-such-bucket" }, errdefs.ErrNotFound},
		{"nothing listening", func(c *s3.Config) { c.Endpoint = "127.0.0.1:1"; c.MaxRetries = 1 }, errdefs.ErrUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := cfg
			tc.mutate(&c)
			b, err := s3.New(c)
			if err != nil {
				t.Fatal(err)
			}
			if err := b.Put(ctx, "k", strings.NewReader("v"), 1); !errors.Is(err, tc.want) {
				t.Errorf("Put error = %v, want %v", err, tc.want)
			}
			if _, err := b.Exists(ctx, "k"); !errors.Is(err, tc.want) {
				t.Errorf("Exists error = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestConfigValidate(t *testing.T) {
	ok := s3.Config{Endpoint: "127.0.0.1:9000", Bucket: "b"}
	for _, tc := range []struct {
		name   string
		mutate func(c *s3.Config)
		field  string
	}{
		{"valid", func(c *s3.Config) {}, ""},
		{"no endpoint", func(c *s3.Config) { c.Endpoint = "" }, "s3.endpoint"},
		{"scheme in endpoint", func(c *s3.Config) { c.Endpoint = "http://x:9000" }, "s3.endpoint"},
		{"no bucket", func(c *s3.Config) { c.Bucket = "" }, "s3.bucket"},
		{"bad prefix", func(c *s3.Config) { c.Prefix = "../x" }, "s3.prefix"},
		{"ca without tls", func(c *s3.Config) { c.CAFile = "/ca.pem" }, "s3.ca_file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			tc.mutate(&c)
			err := c.Validate()
			if tc.field == "" {
				if err != nil {
					t.Fatalf("Validate = %v", err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrInvalid) || !strings.HasPrefix(err.Error(), tc.field+":") {
				t.Errorf("Validate = %v, want ErrInvalid naming %s", err, tc.field)
			}
		})
	}
}
