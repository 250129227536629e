package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"

	"github.com/ember-sandbox/ember/internal/envdclient"
)

// client talks to an ember daemon's API.
type client struct {
	base string
	key  string
	http *http.Client
}

// apiError is the daemon's error body.
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func (e *apiError) Error() string { return fmt.Sprintf("%d: %s", e.Code, e.Message) }

func (c *client) do(ctx context.Context, method, path string, in, out any) (http.Header, error) {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return nil, err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-API-Key", c.key)
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("cannot reach the ember daemon at %s (is `ember serve` running?): %w", c.base, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		var e apiError
		if json.Unmarshal(data, &e) != nil || e.Message == "" {
			e = apiError{Code: resp.StatusCode, Message: strings.TrimSpace(string(data))}
		}
		return resp.Header, &e
	}
	if out != nil && len(data) > 0 {
		if err := json.Unmarshal(data, out); err != nil {
			return nil, fmt.Errorf("decode %s %s: %w", method, path, err)
		}
	}
	return resp.Header, nil
}

// upload POSTs the file at p as the raw request body and decodes the JSON answer into out.
func (c *client) upload(ctx context.Context, path, p string, out any) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", p)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, f)
	if err != nil {
		return err
	}
	req.ContentLength = fi.Size()
	req.Header.Set("X-API-Key", c.key)
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("cannot reach the ember daemon at %s: %w", c.base, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		var e apiError
		if json.Unmarshal(data, &e) != nil || e.Message == "" {
			e = apiError{Code: resp.StatusCode, Message: strings.TrimSpace(string(data))}
		}
		return &e
	}
	return json.Unmarshal(data, out)
}

// stream POSTs in and calls fn for every NDJSON line of the response.
func (c *client) stream(ctx context.Context, path string, in any, fn func(line []byte) error) error {
	b, _ := json.Marshal(in)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("X-API-Key", c.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("cannot reach the ember daemon at %s: %w", c.base, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		data, _ := io.ReadAll(resp.Body)
		var e apiError
		if json.Unmarshal(data, &e) != nil {
			e = apiError{Code: resp.StatusCode, Message: strings.TrimSpace(string(data))}
		}
		return &e
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for sc.Scan() {
		if err := fn(sc.Bytes()); err != nil {
			return err
		}
	}
	return sc.Err()
}

// sandboxTransport adds E2B's sandbox-plane routing headers to every request.
type sandboxTransport struct {
	id, token string
	base      http.RoundTripper
}

func (t *sandboxTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", t.id)
	r.Header.Set("E2b-Sandbox-Port", strconv.Itoa(envdclient.Port))
	if t.token != "" {
		r.Header.Set("X-Access-Token", t.token)
	}
	return t.base.RoundTrip(r)
}

// exec runs cmd in a sandbox through envd's process service (via the daemon's sandbox plane),
// streaming its output to stdout/stderr, and returns its exit code.
func (c *client) exec(ctx context.Context, id string, args []string, user, cwd string, envs map[string]string) (int, error) {
	var info struct {
		EnvdAccessToken string `json:"envdAccessToken"`
	}
	if _, err := c.do(ctx, http.MethodGet, "/sandboxes/"+id, nil, &info); err != nil {
		return -1, err
	}
	hc := &http.Client{Transport: &sandboxTransport{id: id, token: info.EnvdAccessToken, base: http.DefaultTransport}}
	// The transport carries the access token with the routing headers.
	res, err := envdclient.New(hc, c.base, "").Run(ctx,
		envdclient.Command{Line: shellJoin(args), User: user, Cwd: cwd, Envs: envs},
		envdclient.Output{Stdout: func(b []byte) { os.Stdout.Write(b) }, Stderr: func(b []byte) { os.Stderr.Write(b) }})
	if err != nil {
		return -1, err
	}
	return res.ExitCode, nil
}

func shellJoin(args []string) string {
	if len(args) == 1 {
		return args[0] // a single argument is a shell command line
	}
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}
