package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"time"

	"github.com/spf13/cobra"
)

func sandboxCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "sandbox", Aliases: []string{"sbx"}, Short: "Create, list, run commands in, pause, resume, checkpoint, roll back, fork, snapshot and kill sandboxes"}

	var tpl string
	var timeout int
	var meta, envs []string
	create := &cobra.Command{
		Use:   "create",
		Short: "Create a sandbox from a template or snapshot",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			md, err := parseKV(meta)
			if err != nil {
				return err
			}
			ev, err := parseKV(envs)
			if err != nil {
				return err
			}
			body := map[string]any{"templateID": tpl, "timeout": timeout, "metadata": md, "envVars": ev}
			var out map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/v2/sandboxes", body, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			fmt.Println(str(out["sandboxID"]))
			return nil
		},
	}
	create.Flags().StringVarP(&tpl, "template", "t", "base", "template or snapshot id")
	create.Flags().IntVar(&timeout, "timeout", 300, "seconds until the sandbox is killed")
	create.Flags().StringArrayVar(&meta, "metadata", nil, "KEY=VALUE metadata (repeatable)")
	create.Flags().StringArrayVarP(&envs, "env", "e", nil, "KEY=VALUE environment variable (repeatable)")

	var state string
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List sandboxes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var all []map[string]any
			next := ""
			for {
				path := "/v2/sandboxes?limit=100&state=" + state
				if next != "" {
					path += "&nextToken=" + next
				}
				var page []map[string]any
				h, err := g.client().do(cmd.Context(), http.MethodGet, path, nil, &page)
				if err != nil {
					return err
				}
				all = append(all, page...)
				if next = h.Get("X-Next-Token"); next == "" {
					break
				}
			}
			if g.asJSON {
				if all == nil {
					all = []map[string]any{}
				}
				return printJSON(all)
			}
			rows := [][]string{}
			for _, s := range all {
				rows = append(rows, []string{str(s["sandboxID"]), str(s["templateID"]), str(s["state"]), str(s["pausedIn"]), str(s["startedAt"]), str(s["endAt"]), str(s["metadata"])})
			}
			table([]string{"ID", "TEMPLATE", "STATE", "PAUSED IN", "STARTED", "ENDS", "METADATA"}, rows)
			return nil
		},
	}
	ls.Flags().StringVar(&state, "state", "running,paused", "states to list")

	var user, cwd string
	var execEnvs []string
	exec := &cobra.Command{
		Use:   "exec ID -- COMMAND [ARGS...]",
		Short: "Run a command in a sandbox through envd, streaming its output; exits with its exit code",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ev, err := parseKV(execEnvs)
			if err != nil {
				return err
			}
			code, err := g.client().exec(cmd.Context(), args[0], args[1:], user, cwd, ev)
			if err != nil {
				return err
			}
			if g.asJSON {
				printJSON(map[string]any{"exitCode": code})
			}
			if code != 0 {
				return &ExitError{Code: code}
			}
			return nil
		},
	}
	exec.Flags().StringVarP(&user, "user", "u", "", "user to run as (default: the sandbox's default user)")
	exec.Flags().StringVar(&cwd, "cwd", "", "working directory")
	exec.Flags().StringArrayVarP(&execEnvs, "env", "e", nil, "KEY=VALUE environment variable (repeatable)")

	simple := func(use, short, method, pathFmt string, okMsg string) *cobra.Command {
		return &cobra.Command{
			Use: use + " ID", Short: short, Args: cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				var out any
				if _, err := g.client().do(cmd.Context(), method, fmt.Sprintf(pathFmt, args[0]), map[string]any{}, &out); err != nil {
					return err
				}
				if g.asJSON {
					if out == nil {
						out = map[string]any{"sandboxID": args[0], "ok": true}
					}
					return printJSON(out)
				}
				fmt.Println(okMsg, args[0])
				return nil
			},
		}
	}
	kill := &cobra.Command{
		Use: "kill ID", Short: "Kill a sandbox and release everything it holds", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := g.client().do(cmd.Context(), http.MethodDelete, "/sandboxes/"+args[0], nil, nil); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(map[string]any{"sandboxID": args[0], "killed": true})
			}
			fmt.Println("killed", args[0])
			return nil
		},
	}
	pause := simple("pause", "Pause a sandbox (frozen in place, its state written to disk in the background; resume continues it with its memory, processes and files)", http.MethodPost, "/sandboxes/%s/pause", "paused")
	var resumeTimeout int
	resume := &cobra.Command{
		Use: "resume ID", Short: "Resume a paused sandbox", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/v2/sandboxes/"+args[0]+"/connect", map[string]any{"timeout": resumeTimeout}, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			fmt.Println("running", args[0])
			return nil
		},
	}
	resume.Flags().IntVar(&resumeTimeout, "timeout", 300, "seconds until the sandbox is killed")

	var n, forkTimeout int
	var forkCkpt, snapCkpt string
	fork := &cobra.Command{
		Use: "fork ID", Short: "Fork a running sandbox into N independent children", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out []map[string]any
			start := time.Now()
			body := map[string]any{"count": n, "timeout": forkTimeout}
			if forkCkpt != "" {
				body["checkpointID"] = forkCkpt
			}
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/sandboxes/"+args[0]+"/fork", body, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			failed := 0
			for _, r := range out {
				if sb, ok := r["sandbox"].(map[string]any); ok {
					fmt.Println(str(sb["sandboxID"]))
				} else {
					failed++
					fmt.Fprintln(os.Stderr, "error:", str(r["error"]))
				}
			}
			fmt.Fprintf(os.Stderr, "%d children in %s\n", len(out)-failed, time.Since(start).Round(time.Millisecond))
			if failed > 0 {
				return &ExitError{Code: 1}
			}
			return nil
		},
	}
	fork.Flags().IntVarP(&n, "count", "n", 1, "number of children (1-64)")
	fork.Flags().IntVar(&forkTimeout, "timeout", 300, "children's timeout in seconds")
	fork.Flags().StringVar(&forkCkpt, "checkpoint", "", "fork from this step checkpoint of the sandbox")

	var snapName string
	snap := &cobra.Command{
		Use: "snapshot ID", Short: "Snapshot a running sandbox (usable as a template)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			body := map[string]any{}
			if snapName != "" {
				body["name"] = snapName
			}
			if snapCkpt != "" {
				body["checkpointID"] = snapCkpt
			}
			var out map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/sandboxes/"+args[0]+"/snapshots", body, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			fmt.Println(str(out["snapshotID"]))
			return nil
		},
	}
	snap.Flags().StringVar(&snapName, "name", "", "snapshot name")
	snap.Flags().StringVar(&snapCkpt, "checkpoint", "", "promote this step checkpoint of the sandbox instead of capturing it now")

	info := &cobra.Command{
		Use: "info ID", Short: "Show a sandbox", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodGet, "/sandboxes/"+args[0], nil, &out); err != nil {
				return err
			}
			return printJSON(out)
		},
	}
	c.AddCommand(create, ls, exec, shellCmd(g), kill, pause, resume, fork, snap, info)
	c.AddCommand(checkpointCmds(g)...) // checkpoints.go
	return c
}

func templateCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "template", Aliases: []string{"tpl"}, Short: "Build and list templates"}
	var startCmd, readyCmd, fromImage, fromArchive, dockerfilePath, contextDir string
	var buildArgs []string
	var force, insecure bool
	build := &cobra.Command{
		Use:   "build NAME",
		Short: "Build a template from Debian bookworm (debootstrap), an OCI/Docker image or a Dockerfile, boot it once and checkpoint it",
		Long: `Build a template from Debian bookworm (debootstrap), an OCI/Docker image or a Dockerfile, boot it once and checkpoint it.

With --dockerfile, the Dockerfile is built through E2B's template build API (as the SDK's
Template.build does): FROM a template of the daemon or an image, RUN, ENV, ARG, WORKDIR, USER,
COPY/ADD of files in --context (default: the Dockerfile's directory, honouring .dockerignore),
and CMD/ENTRYPOINT as the start command unless --start-cmd is given. With --json it prints each
build log entry as a JSON line, then the result.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if dockerfilePath != "" {
				if fromImage != "" || fromArchive != "" || insecure {
					return fmt.Errorf("--dockerfile excludes --from-image, --from-archive and --insecure-registry")
				}
				ba, err := parseKV(buildArgs)
				if err != nil {
					return fmt.Errorf("--build-arg %w", err)
				}
				b := &dockerfileBuild{name: args[0], dockerfile: dockerfilePath, context: contextDir, buildArgs: ba,
					startCmd: startCmd, readyCmd: readyCmd, force: force,
					out: os.Stdout, errOut: os.Stderr, asJSON: g.asJSON, tty: isTTY() && !g.asJSON, poll: 200 * time.Millisecond}
				return b.run(cmd.Context(), g.client())
			}
			if contextDir != "" || len(buildArgs) > 0 {
				return fmt.Errorf("--context and --build-arg need --dockerfile")
			}
			from := "debian:bookworm"
			switch {
			case fromImage != "" && fromArchive != "":
				return fmt.Errorf("--from-image and --from-archive exclude each other")
			case fromImage != "" && insecure:
				from = "docker+http://" + fromImage
			case fromImage != "":
				from = "docker://" + fromImage
			case fromArchive != "":
				// The daemon builds only from archives in its import directory: send it the file.
				var imp struct {
					Name string `json:"name"`
					Size int64  `json:"size"`
				}
				if !g.asJSON {
					fmt.Printf("uploading %s\n", fromArchive)
				}
				if err := g.client().upload(cmd.Context(), "/ember/imports", fromArchive, &imp); err != nil {
					return fmt.Errorf("upload %s: %w", fromArchive, err)
				}
				defer g.client().do(context.WithoutCancel(cmd.Context()), http.MethodDelete, "/ember/imports/"+imp.Name, nil, nil)
				from = "archive:" + imp.Name
			case insecure:
				return fmt.Errorf("--insecure-registry needs --from-image")
			}
			body := map[string]any{"from": from, "startCmd": startCmd, "readyCmd": readyCmd, "force": force}
			tty := isTTY() && !g.asJSON
			start := time.Now()
			var result map[string]any
			err := g.client().stream(cmd.Context(), "/ember/templates/"+args[0]+"/build", body, func(line []byte) error {
				var ev struct {
					Line     string          `json:"line"`
					Template json.RawMessage `json:"template"`
					Error    *apiError       `json:"error"`
				}
				if err := json.Unmarshal(line, &ev); err != nil {
					return fmt.Errorf("bad progress line %q: %w", line, err)
				}
				switch {
				case ev.Error != nil:
					return ev.Error
				case ev.Template != nil:
					return json.Unmarshal(ev.Template, &result)
				case g.asJSON:
					return nil
				case tty:
					fmt.Printf("\r\033[K[%6.1fs] %s", time.Since(start).Seconds(), truncate(ev.Line, 100))
				default:
					fmt.Println(ev.Line)
				}
				return nil
			})
			if tty {
				fmt.Println()
			}
			if err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(result)
			}
			fmt.Printf("template %s built in %s\n", args[0], time.Since(start).Round(time.Second))
			return nil
		},
	}
	build.Flags().StringVar(&startCmd, "start-cmd", "", "command started in the template before its checkpoint")
	build.Flags().StringVar(&readyCmd, "ready-cmd", "", "command that must succeed before the checkpoint")
	build.Flags().BoolVar(&force, "force", false, "rebuild even if it exists")
	build.Flags().StringVar(&fromImage, "from-image", "", "build from an OCI/Docker image in a registry (python:3.12, localhost:5000/app:v1)")
	build.Flags().StringVar(&fromArchive, "from-archive", "", "build from a local `docker save` or OCI layout tarball (uploaded to the daemon)")
	build.Flags().BoolVar(&insecure, "insecure-registry", false, "reach --from-image's registry over plain HTTP")
	build.Flags().StringVarP(&dockerfilePath, "dockerfile", "f", "", "build from this Dockerfile (through E2B's template build API)")
	build.Flags().StringVar(&contextDir, "context", "", "build context of --dockerfile, where COPY reads files (default: the Dockerfile's directory)")
	build.Flags().StringArrayVar(&buildArgs, "build-arg", nil, "KEY=VALUE for an ARG of --dockerfile (repeatable)")
	ls := &cobra.Command{
		Use: "ls", Short: "List templates and snapshots", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out []map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodGet, "/templates", nil, &out); err != nil {
				return err
			}
			if g.asJSON {
				if out == nil {
					out = []map[string]any{}
				}
				return printJSON(out)
			}
			rows := [][]string{}
			for _, t := range out {
				state := str(t["snapshotState"])
				if e := str(t["snapshotError"]); e != "" {
					state += ": " + e
				}
				rows = append(rows, []string{str(t["templateID"]), str(t["kind"]), str(t["aliases"]), str(t["createdAt"]), state})
			}
			table([]string{"ID", "KIND", "ALIASES", "CREATED", "SNAPSHOT"}, rows)
			return nil
		},
	}
	rm := &cobra.Command{
		Use: "rm ID", Short: "Delete a template or snapshot", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := g.client().do(cmd.Context(), http.MethodDelete, "/templates/"+args[0], nil, nil); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(map[string]any{"templateID": args[0], "deleted": true})
			}
			fmt.Println("deleted", args[0])
			return nil
		},
	}
	pools := &cobra.Command{
		Use: "pools", Short: "Show the warm pools (as `ember pool ls`)", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return listPools(cmd.Context(), g) },
	}
	c.AddCommand(build, ls, rm, pools)
	return c
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}

func keysCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "keys", Short: "Create, list and revoke API keys"}
	var name, team string
	var admin bool
	create := &cobra.Command{
		Use: "create", Short: "Create an API key (printed once)", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out map[string]any
			body := map[string]any{"name": name, "team": team, "admin": admin}
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/api-keys", body, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			fmt.Println(str(out["key"]))
			return nil
		},
	}
	create.Flags().StringVar(&name, "name", "cli", "key name")
	create.Flags().StringVar(&team, "team", "", "the team of the key (an admin key's choice; default: the caller's)")
	create.Flags().BoolVar(&admin, "admin", false, "an admin key (manages teams and every team's keys; needs an admin key)")
	var lsTeam string
	ls := &cobra.Command{
		Use: "ls", Short: "List API keys", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out []map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodGet, "/api-keys?team="+url.QueryEscape(lsTeam), nil, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			rows := [][]string{}
			for _, k := range out {
				role := ""
				if k["admin"] == true {
					role = "admin"
				}
				rows = append(rows, []string{str(k["id"]), str(k["name"]), str(k["mask"]), str(k["team"]), role, str(k["createdAt"])})
			}
			table([]string{"ID", "NAME", "KEY", "TEAM", "ROLE", "CREATED"}, rows)
			return nil
		},
	}
	ls.Flags().StringVar(&lsTeam, "team", "", "the team whose keys to list (an admin key's choice; * for every team)")
	revoke := &cobra.Command{
		Use: "revoke ID", Short: "Revoke an API key", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := g.client().do(cmd.Context(), http.MethodDelete, "/api-keys/"+args[0], nil, nil); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(map[string]any{"id": args[0], "revoked": true})
			}
			fmt.Println("revoked", args[0])
			return nil
		},
	}
	c.AddCommand(create, ls, revoke)
	return c
}
