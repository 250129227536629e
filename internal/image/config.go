package image

import (
	"fmt"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Defaults is what an image's config says about running it.
type Defaults struct {
	Env      map[string]string
	User     string
	Workdir  string
	StartCmd string // Entrypoint + Cmd as one shell command line; "" for a bare shell
}

// ConfigDefaults maps an image config to Defaults. A Cmd that is only an interactive shell
// (the `bash` of debian, `/bin/sh` of alpine) is not a start command: envd is the sandbox's
// init and starts shells per command.
func ConfigDefaults(cf *v1.ConfigFile) Defaults {
	var d Defaults
	if cf == nil {
		return d
	}
	c := cf.Config
	if len(c.Env) > 0 {
		d.Env = map[string]string{}
		for _, kv := range c.Env {
			k, v, _ := strings.Cut(kv, "=")
			if k != "" {
				d.Env[k] = v
			}
		}
	}
	d.User = c.User
	d.Workdir = c.WorkingDir
	argv := append(append([]string{}, c.Entrypoint...), c.Cmd...)
	if len(argv) == 1 {
		switch argv[0] {
		case "bash", "sh", "/bin/bash", "/bin/sh", "/usr/bin/bash":
			argv = nil
		}
	}
	if len(argv) > 0 {
		q := make([]string, len(argv))
		for i, a := range argv {
			q[i] = shellQuote(a)
		}
		d.StartCmd = strings.Join(q, " ")
	}
	return d
}

func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:@%+,") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Layers returns img's layers after checking the image is linux/amd64 and within the limit.
func Layers(img v1.Image, maxImageBytes int64) ([]v1.Layer, *v1.ConfigFile, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, nil, fmt.Errorf("image config: %w", classify(err))
	}
	if cf.OS != "" && cf.OS != "linux" || cf.Architecture != "" && cf.Architecture != "amd64" {
		return nil, nil, fmt.Errorf("image is %s/%s; this node runs linux/amd64: %w", cf.OS, cf.Architecture, errdefs.ErrInvalid)
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, nil, fmt.Errorf("image layers: %w", classify(err))
	}
	if len(layers) > 127 {
		return nil, nil, fmt.Errorf("image has %d layers (at most 127): %w", len(layers), errdefs.ErrInvalid)
	}
	if maxImageBytes > 0 {
		var total int64
		for _, l := range layers {
			if n, err := l.Size(); err == nil {
				total += n
			}
		}
		if total > maxImageBytes {
			return nil, nil, fmt.Errorf("image is %d bytes compressed, over the limit of %d: %w", total, maxImageBytes, errdefs.ErrExhausted)
		}
	}
	return layers, cf, nil
}
