package cli

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"

	"github.com/spf13/cobra"
)

// quotaFlags are the quota fields `team create` and `team set-quota` take.
var quotaFlags = []struct{ flag, field, help string }{
	{"sandboxes", "sandboxes", "running sandboxes at once"},
	{"cpus", "cpus", "vCPUs of its running sandboxes together"},
	{"memory-mb", "memoryMB", "memory (MiB) of its running sandboxes together"},
	{"paused-disk-mb", "pausedDiskMB", "disk (MiB) of its paused sandboxes together"},
	{"builds", "builds", "template builds at once"},
	{"template-disk-mb", "templateDiskMB", "disk (MiB) of its templates and snapshots together"},
}

func teamCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "team", Aliases: []string{"teams"}, Short: "Create, list and remove teams and set their quotas (admin keys)"}
	addQuota := func(cmd *cobra.Command, vals map[string]*int) {
		for _, q := range quotaFlags {
			v := new(int)
			vals[q.field] = v
			cmd.Flags().IntVar(v, q.flag, 0, "quota: "+q.help+" (0: no limit)")
		}
	}
	quota := func(vals map[string]*int) map[string]int {
		out := map[string]int{}
		for k, v := range vals {
			out[k] = *v
		}
		return out
	}
	createQ := map[string]*int{}
	create := &cobra.Command{
		Use: "create NAME", Short: "Create a team and its first API key (printed once)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/ember/teams", map[string]any{"name": args[0], "quota": quota(createQ)}, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			key, _ := out["apiKey"].(map[string]any)
			fmt.Printf("team %s (%s)\nAPI key (shown once): %s\n", str(out["teamID"]), str(out["name"]), str(key["key"]))
			return nil
		},
	}
	addQuota(create, createQ)
	ls := &cobra.Command{
		Use: "ls", Short: "List teams with their quotas", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out []map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodGet, "/ember/teams", nil, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			rows := [][]string{}
			for _, t := range out {
				q, _ := t["quota"].(map[string]any)
				row := []string{str(t["teamID"]), str(t["name"])}
				for _, f := range quotaFlags {
					row = append(row, quotaCell(q[f.field]))
				}
				rows = append(rows, row)
			}
			table([]string{"ID", "NAME", "SANDBOXES", "CPUS", "MEMORY MB", "PAUSED DISK MB", "BUILDS", "TEMPLATE DISK MB"}, rows)
			return nil
		},
	}
	rm := &cobra.Command{
		Use: "rm ID", Short: "Remove a team and revoke its keys", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := g.client().do(cmd.Context(), http.MethodDelete, "/ember/teams/"+url.PathEscape(args[0]), nil, nil); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(map[string]any{"teamID": args[0], "removed": true})
			}
			fmt.Println("removed", args[0])
			return nil
		},
	}
	setQ := map[string]*int{}
	set := &cobra.Command{
		Use: "set-quota ID", Short: "Set a team's quotas (every one: a flag left out is no limit)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodPut, "/ember/teams/"+url.PathEscape(args[0])+"/quota", quota(setQ), &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			fmt.Println("quota set for", args[0])
			return nil
		},
	}
	addQuota(set, setQ)
	usage := &cobra.Command{
		Use: "usage ID", Short: "Show a team's quotas and what it holds (on the node asked)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodGet, "/ember/teams/"+url.PathEscape(args[0])+"/usage", nil, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			q, _ := out["quota"].(map[string]any)
			u, _ := out["usage"].(map[string]any)
			rows := [][]string{}
			for _, f := range quotaFlags {
				used, _ := u[f.field].(float64)
				rows = append(rows, []string{f.field, strconv.FormatFloat(used, 'f', -1, 64), quotaCell(q[f.field])})
			}
			table([]string{"QUOTA", "USED", "LIMIT"}, rows)
			return nil
		},
	}
	c.AddCommand(create, ls, rm, set, usage)
	return c
}

func quotaCell(v any) string {
	f, ok := v.(float64)
	if !ok || f == 0 {
		return "-"
	}
	return strconv.FormatFloat(f, 'f', -1, 64)
}
