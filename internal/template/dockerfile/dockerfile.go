// Package dockerfile translates a Dockerfile into a build of E2B's template build API (the
// request body of POST /v2/templates/{id}/builds/{buildID} and the file sets its COPY steps
// upload), encoding steps exactly as the official SDK's Template builder does, so a Dockerfile
// and the equivalent SDK template share the daemon's caches. It is pure: it reads the
// Dockerfile and the build context and talks to nothing; the CLI sends what it returns. The
// syntax is parsed by BuildKit's Dockerfile parser; words are expanded by BuildKit's shell
// lexer.
//
// Semantics follow the SDK's Template.fromDockerfile where it defines them (steps start as
// root in /, end as `user` in /home/user unless USER/WORKDIR say otherwise; ARG sets an
// environment variable like ENV) and Docker's where it does not (variable substitution,
// ENTRYPOINT+CMD, .dockerignore patterns). What a single-stage build cannot do is refused
// with the file and line.
package dockerfile

import (
	"bytes"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Step is one step of a template build, as the SDK serialises it.
type Step struct {
	Type      string   `json:"type"`
	Args      []string `json:"args"`
	Force     bool     `json:"force"`
	FilesHash string   `json:"filesHash,omitempty"`
}

// Request is the body of POST /v2/templates/{templateID}/builds/{buildID} (TemplateBuildStartV2).
type Request struct {
	StartCmd     string `json:"startCmd,omitempty"`
	ReadyCmd     string `json:"readyCmd,omitempty"`
	Steps        []Step `json:"steps"`
	Force        bool   `json:"force"`
	FromImage    string `json:"fromImage,omitempty"`
	FromTemplate string `json:"fromTemplate,omitempty"`
}

// Options is the input of Translate.
type Options struct {
	Dockerfile []byte
	Name       string            // how errors name the file ("Dockerfile"); default "Dockerfile"
	Context    string            // build context directory COPY sources are read from
	BuildArgs  map[string]string // --build-arg values, overriding ARG defaults
}

// Result is a translated Dockerfile.
type Result struct {
	// Request has FromImage set to FROM's reference; the caller moves it to FromTemplate when
	// the daemon has a template of that name.
	Request Request
	// Files are the COPY/ADD sources to upload, in step order, one per COPY step.
	Files []*FileSet
	// Warnings are lines for the user: ignored instructions, unused build args.
	Warnings []string
}

// Error is a Dockerfile problem at a line.
type Error struct {
	File string
	Line int
	Msg  string
}

func (e *Error) Error() string {
	if e.Line > 0 {
		return fmt.Sprintf("%s:%d: %s", e.File, e.Line, e.Msg)
	}
	return e.File + ": " + e.Msg
}

func (e *Error) Unwrap() error { return errdefs.ErrInvalid }

// translator holds the state of one Translate call.
type translator struct {
	o       Options
	ctx     *buildContext
	res     *Result
	env     map[string]string // ARG and ENV values in scope, for substitution
	usedArg map[string]bool
	lex     *shell.Lex

	entrypoint, cmd     *instructions.ShellDependantCmdLine
	userSet, workdirSet bool
	seenFrom            bool
}

// Translate turns a Dockerfile into a template build request and the file sets to upload.
func Translate(o Options) (*Result, error) {
	if o.Name == "" {
		o.Name = "Dockerfile"
	}
	t := &translator{o: o, res: &Result{}, env: map[string]string{}, usedArg: map[string]bool{}}
	ast, err := parser.Parse(bytes.NewReader(o.Dockerfile))
	if err != nil {
		return nil, t.errAt(lineOf(err), "%s", cleanMsg(err))
	}
	for _, w := range ast.Warnings {
		var loc []parser.Range
		if w.Location != nil {
			loc = []parser.Range{*w.Location}
		}
		t.warn(loc, "%s", w.Short)
	}
	t.lex = shell.NewLex(ast.EscapeToken)
	if t.ctx, err = openContext(o.Context); err != nil {
		return nil, &Error{File: o.Name, Msg: err.Error()}
	}
	// The SDK's fromDockerfile starts as root in / (a Dockerfile's defaults).
	t.step("USER", "root")
	t.step("WORKDIR", "/")
	for _, n := range ast.AST.Children {
		if err := t.instruction(n); err != nil {
			var e *Error
			if errors.As(err, &e) {
				return nil, e
			}
			return nil, t.errAt(n.StartLine, "%s", cleanMsg(err))
		}
	}
	if !t.seenFrom {
		return nil, t.errAt(0, "no FROM instruction")
	}
	// ... and ends as the SDK's defaults, `user` in its home, unless the Dockerfile chose.
	if !t.userSet {
		t.step("USER", "user")
	}
	if !t.workdirSet {
		t.step("WORKDIR", "/home/user")
	}
	t.res.Request.StartCmd = t.startCmd()
	var unused []string
	for k := range o.BuildArgs {
		if !t.usedArg[k] {
			unused = append(unused, k)
		}
	}
	sort.Strings(unused)
	if len(unused) > 0 {
		t.res.Warnings = append(t.res.Warnings, fmt.Sprintf("%s: build arguments not consumed by any ARG: %s", o.Name, strings.Join(unused, ", ")))
	}
	return t.res, nil
}

func (t *translator) instruction(n *parser.Node) error {
	line := n.StartLine
	kw := strings.ToUpper(n.Value)
	if t.seenFrom && kw == "FROM" {
		return t.errAt(line, "multi-stage builds are not supported (a second FROM)")
	}
	if !t.seenFrom && kw != "FROM" && kw != "ARG" {
		return t.errAt(line, "%s before FROM", kw)
	}
	cmd, err := instructions.ParseInstruction(n)
	if err != nil {
		return t.errAt(line, "%s", cleanMsg(err))
	}
	switch c := cmd.(type) {
	case *instructions.Stage:
		t.seenFrom = true
		if c.Platform != "" {
			return t.errAt(line, "FROM --platform is not supported")
		}
		base, err := t.expand(c.BaseName, false)
		if err != nil {
			return t.errAt(line, "%s", cleanMsg(err))
		}
		if base == "" || base == "scratch" {
			return t.errAt(line, "FROM %q is not supported: a template needs a base with a shell", c.BaseName)
		}
		t.res.Request.FromImage = base
	case *instructions.ArgCommand:
		var args []string
		for _, a := range c.Args {
			v := ""
			if a.Value != nil {
				if v, err = t.expand(*a.Value, true); err != nil {
					return t.errAt(line, "%s", cleanMsg(err))
				}
			}
			if bv, ok := t.o.BuildArgs[a.Key]; ok {
				v = bv
				t.usedArg[a.Key] = true
			}
			t.env[a.Key] = v
			args = append(args, a.Key, v)
		}
		// As the SDK does: an ARG is an environment variable from here on.
		t.step("ENV", args...)
	case *instructions.EnvCommand:
		var args []string
		for _, kv := range c.Env {
			k, err := t.expand(kv.Key, false)
			if err != nil {
				return t.errAt(line, "%s", cleanMsg(err))
			}
			v, err := t.expand(kv.Value, true)
			if err != nil {
				return t.errAt(line, "%s", cleanMsg(err))
			}
			args = append(args, k, v)
		}
		for i := 0; i < len(args); i += 2 {
			t.env[args[i]] = args[i+1]
		}
		t.step("ENV", args...)
	case *instructions.RunCommand:
		if len(c.FlagsUsed) > 0 {
			return t.errAt(line, "RUN --%s is not supported", c.FlagsUsed[0])
		}
		if len(c.Files) > 0 {
			return t.errAt(line, "heredocs are not supported")
		}
		t.step("RUN", cmdLine(c.ShellDependantCmdLine))
	case *instructions.WorkdirCommand:
		p, err := t.expand(c.Path, true)
		if err != nil {
			return t.errAt(line, "%s", cleanMsg(err))
		}
		t.workdirSet = true
		t.step("WORKDIR", p)
	case *instructions.UserCommand:
		u, err := t.expand(c.User, true)
		if err != nil {
			return t.errAt(line, "%s", cleanMsg(err))
		}
		t.userSet = true
		t.step("USER", u)
	case *instructions.CopyCommand:
		switch {
		case c.From != "":
			return t.errAt(line, "COPY --from is not supported (multi-stage builds)")
		case c.Parents:
			return t.errAt(line, "COPY --parents is not supported")
		case len(c.ExcludePatterns) > 0:
			return t.errAt(line, "COPY --exclude is not supported")
		}
		return t.copy(line, "COPY", &c.SourcesAndDest, c.Chown, c.Chmod)
	case *instructions.AddCommand:
		switch {
		case c.Checksum != "":
			return t.errAt(line, "ADD --checksum is not supported")
		case c.KeepGitDir != nil:
			return t.errAt(line, "ADD --keep-git-dir is not supported")
		case c.Unpack != nil:
			return t.errAt(line, "ADD --unpack is not supported")
		case len(c.ExcludePatterns) > 0:
			return t.errAt(line, "ADD --exclude is not supported")
		}
		for _, s := range c.SourcePaths {
			if isRemote(s) {
				return t.errAt(line, "ADD of a URL (%s) is not supported: download it in a RUN step", s)
			}
			if isArchive(s) {
				t.warn([]parser.Range{{Start: parser.Position{Line: line}}}, "ADD copies %s as a file, it does not extract archives (use RUN tar -x)", s)
			}
		}
		return t.copy(line, "ADD", &c.SourcesAndDest, c.Chown, c.Chmod)
	case *instructions.CmdCommand:
		if len(c.Files) > 0 {
			return t.errAt(line, "heredocs are not supported")
		}
		cl := c.ShellDependantCmdLine
		t.cmd = &cl
	case *instructions.EntrypointCommand:
		if len(c.Files) > 0 {
			return t.errAt(line, "heredocs are not supported")
		}
		cl := c.ShellDependantCmdLine
		t.entrypoint = &cl
	case *instructions.LabelCommand, *instructions.ExposeCommand, *instructions.MaintainerCommand,
		*instructions.StopSignalCommand, *instructions.VolumeCommand:
		t.warn(n.Location(), "%s is ignored", kw)
	default:
		// HEALTHCHECK, ONBUILD, SHELL, and anything BuildKit adds later.
		return t.errAt(line, "%s is not supported", kw)
	}
	return nil
}

// copy adds one COPY step per source, as the SDK's copy() does.
func (t *translator) copy(line int, kw string, sd *instructions.SourcesAndDest, chown, chmod string) error {
	if len(sd.SourceContents) > 0 {
		return t.errAt(line, "heredocs are not supported")
	}
	dest, err := t.expand(sd.DestPath, true)
	if err != nil {
		return t.errAt(line, "%s", cleanMsg(err))
	}
	if len(sd.SourcePaths) > 1 && !strings.HasSuffix(dest, "/") {
		return t.errAt(line, "%s with several sources needs a destination ending in /", kw)
	}
	if chown, err = t.expand(chown, false); err != nil {
		return t.errAt(line, "%s", cleanMsg(err))
	}
	mode := ""
	if chmod != "" {
		m, err := strconv.ParseUint(chmod, 8, 32)
		if err != nil || m > 0o7777 {
			return t.errAt(line, "%s --chmod=%s: want an octal mode such as 0755", kw, chmod)
		}
		mode = fmt.Sprintf("%04o", m)
	}
	for _, raw := range sd.SourcePaths {
		src, err := t.expand(raw, false)
		if err != nil {
			return t.errAt(line, "%s", cleanMsg(err))
		}
		entries, err := t.ctx.collect(src)
		if err != nil {
			return t.errAt(line, "%s: %s", kw, err)
		}
		hash, err := filesHash(t.ctx.root, src, dest, entries)
		if err != nil {
			return t.errAt(line, "%s %s: %s", kw, src, err)
		}
		t.res.Request.Steps = append(t.res.Request.Steps, Step{Type: "COPY", Args: []string{src, dest, chown, mode}, FilesHash: hash})
		t.res.Files = append(t.res.Files, &FileSet{Src: src, Dest: dest, Hash: hash, Line: line, root: t.ctx.root, entries: entries})
	}
	return nil
}

// expand substitutes $VAR and ${VAR...} from the Dockerfile's ARG and ENV values. With keep,
// a variable the Dockerfile does not define (PATH from the base image, say) is left as written
// for the build's shell to expand; without, it is empty, as Docker does.
func (t *translator) expand(word string, keep bool) (string, error) {
	if word == "" {
		return "", nil
	}
	env := make([]string, 0, len(t.env))
	for k, v := range t.env {
		env = append(env, k+"="+v)
	}
	t.lex.SkipUnsetEnv = keep
	out, _, err := t.lex.ProcessWord(word, shell.EnvsFromSlice(env))
	return out, err
}

func (t *translator) step(typ string, args ...string) {
	if args == nil {
		args = []string{}
	}
	t.res.Request.Steps = append(t.res.Request.Steps, Step{Type: typ, Args: args})
}

// startCmd is Docker's ENTRYPOINT + CMD as one shell command line: an exec-form ENTRYPOINT
// takes CMD as arguments; a shell-form one ignores CMD.
func (t *translator) startCmd() string {
	switch {
	case t.entrypoint == nil && t.cmd == nil:
		return ""
	case t.entrypoint == nil:
		return cmdLine(*t.cmd)
	case t.entrypoint.PrependShell || t.cmd == nil:
		return cmdLine(*t.entrypoint)
	case t.cmd.PrependShell:
		return cmdLine(*t.entrypoint) + " /bin/sh -c " + quote(t.cmd.CmdLine[0])
	default:
		return cmdLine(*t.entrypoint) + " " + quoteAll(t.cmd.CmdLine)
	}
}

// cmdLine is a RUN/CMD/ENTRYPOINT as the shell command line the daemon runs: the shell form
// as written, the exec form quoted word by word.
func cmdLine(c instructions.ShellDependantCmdLine) string {
	if c.PrependShell {
		return strings.Join(c.CmdLine, " ")
	}
	return quoteAll(c.CmdLine)
}

func quoteAll(words []string) string {
	q := make([]string, len(words))
	for i, w := range words {
		q[i] = quote(w)
	}
	return strings.Join(q, " ")
}

// quote shell-quotes a word when it needs it.
func quote(w string) string {
	if w != "" && strings.Trim(w, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == "" {
		return w
	}
	return "'" + strings.ReplaceAll(w, "'", `'\''`) + "'"
}

func isRemote(s string) bool {
	for _, p := range []string{"http://", "https://", "git@", "git://", "ssh://"} {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

func isArchive(s string) bool {
	for _, x := range []string{".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst"} {
		if strings.HasSuffix(s, x) {
			return true
		}
	}
	return false
}

func (t *translator) errAt(line int, format string, args ...any) *Error {
	return &Error{File: t.o.Name, Line: line, Msg: fmt.Sprintf(format, args...)}
}

func (t *translator) warn(loc []parser.Range, format string, args ...any) {
	line := 0
	if len(loc) > 0 {
		line = loc[0].Start.Line
	}
	t.res.Warnings = append(t.res.Warnings, (&Error{File: t.o.Name, Line: line, Msg: fmt.Sprintf(format, args...)}).Error())
}

// lineOf is the first line a BuildKit error carries.
func lineOf(err error) int {
	var le *parser.LocationError
	if errors.As(err, &le) && len(le.Locations) > 0 && len(le.Locations[0]) > 0 {
		return le.Locations[0][0].Start.Line
	}
	return 0
}

// cleanMsg drops BuildKit's own "dockerfile parse error on line N:" prefix (we add file:line).
func cleanMsg(err error) string {
	msg := err.Error()
	if i := strings.Index(msg, "dockerfile parse error on line "); i >= 0 {
		if j := strings.Index(msg[i:], ": "); j >= 0 {
			msg = msg[i+j+2:]
		}
	}
	return msg
}
