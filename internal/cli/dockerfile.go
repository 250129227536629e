package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/ember-sandbox/ember/internal/image"
	"github.com/ember-sandbox/ember/internal/template/dockerfile"
)

// dockerfileBuild is `ember template build NAME --dockerfile PATH`: the Dockerfile is
// translated here (internal/template/dockerfile) and built through E2B's template build API,
// the same calls the SDK's Template.build makes: POST /v3/templates, an upload per COPY whose
// files the daemon does not have, POST /v2/templates/{id}/builds/{buildID}, then the build
// status polled for its log lines.
type dockerfileBuild struct {
	name       string
	dockerfile string // path
	context    string // default: the Dockerfile's directory
	buildArgs  map[string]string
	startCmd   string // overrides CMD/ENTRYPOINT
	readyCmd   string
	force      bool

	out, errOut io.Writer
	asJSON, tty bool
	poll        time.Duration // status poll interval (the SDK's 200ms)
}

// buildResult is what --json prints last.
type buildResult struct {
	TemplateID string `json:"templateID"`
	BuildID    string `json:"buildID"`
	Name       string `json:"name"`
	Status     string `json:"status"`
}

// logEntry is one line of a build's log (the API's BuildLogEntry).
type logEntry struct {
	Timestamp string `json:"timestamp"`
	Level     string `json:"level"`
	Message   string `json:"message"`
	Step      string `json:"step,omitempty"`
}

func (b *dockerfileBuild) run(ctx context.Context, c *client) error {
	start := time.Now()
	src, err := os.ReadFile(b.dockerfile)
	if err != nil {
		return err
	}
	res, err := translateDockerfile(src, b.dockerfile, b.context, b.buildArgs)
	if err != nil {
		return err
	}
	for _, w := range res.Warnings {
		fmt.Fprintln(b.errOut, "warning:", w)
	}
	req := res.Request
	if b.startCmd != "" {
		req.StartCmd = b.startCmd
	}
	if b.readyCmd != "" {
		req.ReadyCmd = b.readyCmd
	}
	req.Force = b.force
	// FROM names a template of the daemon if it has one, else an image (which the daemon
	// resolves through its image aliases and mirrors: FROM e2bdev/base is ember's base).
	isTemplate, err := c.templateExists(ctx, req.FromImage)
	if err != nil {
		return err
	}
	if isTemplate {
		req.FromTemplate, req.FromImage = req.FromImage, ""
		b.logf(start, "FROM %s: the template of that name", req.FromTemplate)
	} else {
		b.logf(start, "FROM %s: an image", req.FromImage)
	}

	var created struct {
		TemplateID string `json:"templateID"`
		BuildID    string `json:"buildID"`
	}
	if _, err := c.do(ctx, http.MethodPost, "/v3/templates", map[string]any{"name": b.name}, &created); err != nil {
		return fmt.Errorf("requesting the build: %w", err)
	}
	if created.TemplateID == "" || created.BuildID == "" {
		return fmt.Errorf("requesting the build: the daemon returned no templateID/buildID")
	}
	b.logf(start, "template %s, build %s", created.TemplateID, created.BuildID)
	tid := url.PathEscape(created.TemplateID)

	done := map[string]bool{}
	for _, fs := range res.Files {
		if done[fs.Hash] {
			continue
		}
		done[fs.Hash] = true
		var link struct {
			Present bool              `json:"present"`
			URL     string            `json:"url"`
			Headers map[string]string `json:"headers"`
		}
		if _, err := c.do(ctx, http.MethodGet, "/templates/"+tid+"/files/"+fs.Hash, nil, &link); err != nil {
			return fmt.Errorf("%s:%d: COPY %s: %w", filepath.Base(b.dockerfile), fs.Line, fs.Src, err)
		}
		if link.Present || link.URL == "" {
			b.logf(start, "COPY %s: already on the daemon", fs.Src)
			continue
		}
		n, err := c.uploadFiles(ctx, link.URL, link.Headers, fs)
		if err != nil {
			return fmt.Errorf("%s:%d: COPY %s: upload: %w", filepath.Base(b.dockerfile), fs.Line, fs.Src, err)
		}
		b.logf(start, "COPY %s: uploaded %d files (%s compressed)", fs.Src, len(fs.Paths()), image.HumanBytes(n))
	}

	if _, err := c.do(ctx, http.MethodPost, "/v2/templates/"+tid+"/builds/"+url.PathEscape(created.BuildID), req, nil); err != nil {
		return fmt.Errorf("starting the build: %w", err)
	}
	status, err := b.wait(ctx, c, start, tid, url.PathEscape(created.BuildID))
	if err != nil {
		return err
	}
	r := buildResult{TemplateID: created.TemplateID, BuildID: created.BuildID, Name: b.name, Status: status}
	if b.asJSON {
		return json.NewEncoder(b.out).Encode(r)
	}
	fmt.Fprintf(b.out, "template %s built in %s\n", b.name, time.Since(start).Round(time.Second))
	return nil
}

// translateDockerfile translates the Dockerfile at path (read as src) with its context
// directory (default: the Dockerfile's own).
func translateDockerfile(src []byte, path, contextDir string, buildArgs map[string]string) (*dockerfile.Result, error) {
	if contextDir == "" {
		contextDir = filepath.Dir(path)
	}
	return dockerfile.Translate(dockerfile.Options{Dockerfile: src, Name: filepath.Base(path), Context: contextDir, BuildArgs: buildArgs})
}

// wait polls the build's status, printing its log entries, until it is ready or failed.
func (b *dockerfileBuild) wait(ctx context.Context, c *client, start time.Time, tid, bid string) (string, error) {
	offset := 0
	poll := func() (string, *struct{ Message, Step string }, int, error) {
		var st struct {
			Status     string     `json:"status"`
			LogEntries []logEntry `json:"logEntries"`
			Reason     *struct {
				Message string `json:"message"`
				Step    string `json:"step"`
			} `json:"reason"`
		}
		path := "/templates/" + tid + "/builds/" + bid + "/status?logsOffset=" + strconv.Itoa(offset)
		if _, err := c.do(ctx, http.MethodGet, path, nil, &st); err != nil {
			if ctx.Err() != nil {
				return "", nil, 0, fmt.Errorf("stopped waiting (the build goes on on the daemon: GET /templates/%s/builds/%s/status): %w", tid, bid, ctx.Err())
			}
			return "", nil, 0, fmt.Errorf("build status: %w", err)
		}
		offset += len(st.LogEntries)
		for _, e := range st.LogEntries {
			b.printLog(start, e)
		}
		var reason *struct{ Message, Step string }
		if st.Reason != nil {
			reason = &struct{ Message, Step string }{st.Reason.Message, st.Reason.Step}
		}
		return st.Status, reason, len(st.LogEntries), nil
	}
	for {
		status, reason, _, err := poll()
		if err != nil {
			return "", err
		}
		switch status {
		case "building", "waiting":
		case "ready", "error":
			// The SDK reads on until a poll brings no more lines.
			for {
				_, _, n, err := poll()
				if err != nil {
					return "", err
				}
				if n == 0 {
					break
				}
			}
			if status == "ready" {
				return status, nil
			}
			msg := "unknown error"
			if reason != nil && reason.Message != "" {
				msg = reason.Message
				if reason.Step != "" {
					msg = "step " + reason.Step + ": " + msg
				}
			}
			return "", fmt.Errorf("build failed: %s", msg)
		default:
			return "", fmt.Errorf("build status: unexpected status %q", status)
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("stopped waiting (the build goes on on the daemon: GET /templates/%s/builds/%s/status): %w", tid, bid, ctx.Err())
		case <-time.After(b.poll):
		}
	}
}

// uploadFiles PUTs the file set's tarball to url with an exact Content-Length, as the SDK does
// (spooled to a temporary file first), and returns its size.
func (c *client) uploadFiles(ctx context.Context, rawURL string, headers map[string]string, fs *dockerfile.FileSet) (int64, error) {
	base, err := url.Parse(c.base)
	if err != nil {
		return 0, err
	}
	u, err := base.Parse(rawURL) // the daemon may answer a path of its own
	if err != nil {
		return 0, err
	}
	f, err := os.CreateTemp("", "ember-copy-*.tar.gz")
	if err != nil {
		return 0, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if err := fs.WriteTar(f); err != nil {
		return 0, err
	}
	size, err := f.Seek(0, io.SeekCurrent)
	if err != nil {
		return 0, err
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return 0, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, u.String(), io.NopCloser(f))
	if err != nil {
		return 0, err
	}
	req.ContentLength = size
	for k, v := range headers {
		if http.CanonicalHeaderKey(k) != "Content-Length" {
			req.Header.Set(k, v)
		}
	}
	if u.Host == base.Host && req.Header.Get("X-API-Key") == "" {
		req.Header.Set("X-API-Key", c.key) // never sent to another host (a presigned store URL)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return 0, fmt.Errorf("%s: %s", resp.Status, body)
	}
	return size, nil
}

// templateExists asks the daemon whether name is a template (GET /templates/aliases/{name}:
// 200 or 403 yes, 404 no), as the SDK's Template.exists does.
func (c *client) templateExists(ctx context.Context, name string) (bool, error) {
	_, err := c.do(ctx, http.MethodGet, "/templates/aliases/"+url.PathEscape(name), nil, nil)
	var ae *apiError
	switch {
	case err == nil:
		return true, nil
	case errors.As(err, &ae) && ae.Code == http.StatusForbidden:
		return true, nil
	case errors.As(err, &ae) && ae.Code == http.StatusNotFound:
		return false, nil
	default:
		return false, fmt.Errorf("looking up template %q: %w", name, err)
	}
}

// logf prints a line of the client's own progress (not with --json, whose stdout is the
// build's log entries and result).
func (b *dockerfileBuild) logf(start time.Time, format string, args ...any) {
	if b.asJSON {
		return
	}
	b.printLine(start, fmt.Sprintf(format, args...))
}

func (b *dockerfileBuild) printLog(start time.Time, e logEntry) {
	if b.asJSON {
		json.NewEncoder(b.out).Encode(e)
		return
	}
	msg := e.Message
	if e.Level == "error" || e.Level == "warn" {
		msg = e.Level + ": " + msg
	}
	b.printLine(start, msg)
}

func (b *dockerfileBuild) printLine(start time.Time, s string) {
	if b.tty {
		fmt.Fprintf(b.out, "[%6.1fs] %s\n", time.Since(start).Seconds(), s)
		return
	}
	fmt.Fprintln(b.out, s)
}
