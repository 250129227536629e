package cli

import (
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// checkpointCmds are the step-checkpoint commands of `ember sandbox`: checkpoint, checkpoints,
// rollback and checkpoint-rm (POST/GET /sandboxes/{id}/checkpoints, POST .../rollback, DELETE
// .../checkpoints/{cid}).
func checkpointCmds(g *globals) []*cobra.Command {
	take := &cobra.Command{
		Use: "checkpoint ID", Short: "Take a step checkpoint of a running sandbox (it keeps running)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out map[string]any
			start := time.Now()
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/sandboxes/"+args[0]+"/checkpoints", nil, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			fmt.Println(str(out["checkpointID"]))
			fmt.Fprintf(os.Stderr, "sandbox stopped %vms, answered in %s\n", out["stoppedMs"], time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	list := &cobra.Command{
		Use: "checkpoints ID", Short: "List a sandbox's checkpoints as a tree (* = the one it was last taken at or rolled back to)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out []map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodGet, "/sandboxes/"+args[0]+"/checkpoints", nil, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			printCheckpointTree(out)
			return nil
		},
	}
	rollback := &cobra.Command{
		Use: "rollback ID CHECKPOINT", Short: "Make a sandbox continue from one of its checkpoints (files, memory, processes)", Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			var out map[string]any
			start := time.Now()
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/sandboxes/"+args[0]+"/rollback", map[string]any{"checkpointID": args[1]}, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			fmt.Println("rolled back", args[0], "to", args[1])
			fmt.Fprintf(os.Stderr, "in %s\n", time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	rm := &cobra.Command{
		Use: "checkpoint-rm ID CHECKPOINT", Short: "Delete a checkpoint of a sandbox", Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := g.client().do(cmd.Context(), http.MethodDelete, "/sandboxes/"+args[0]+"/checkpoints/"+args[1], nil, nil); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(map[string]any{"sandboxID": args[0], "checkpointID": args[1], "deleted": true})
			}
			fmt.Println("deleted", args[1])
			return nil
		},
	}
	return []*cobra.Command{take, list, rollback, rm}
}

// printCheckpointTree prints checkpoints (oldest first, each with its parentID) as an
// indented tree, the current one marked with *.
func printCheckpointTree(cks []map[string]any) {
	children := map[string][]map[string]any{}
	known := map[string]bool{}
	for _, c := range cks {
		known[str(c["checkpointID"])] = true
	}
	var roots []map[string]any
	for _, c := range cks {
		p := str(c["parentID"])
		if p == "" || !known[p] {
			roots = append(roots, c)
			continue
		}
		children[p] = append(children[p], c)
	}
	var walk func(c map[string]any, depth int)
	walk = func(c map[string]any, depth int) {
		mark := " "
		if cur, _ := c["current"].(bool); cur {
			mark = "*"
		}
		id := str(c["checkpointID"])
		fmt.Printf("%s%s %s  %s  stopped %vms\n", strings.Repeat("  ", depth), mark, id, str(c["createdAt"]), c["stoppedMs"])
		for _, k := range children[id] {
			walk(k, depth+1)
		}
	}
	for _, r := range roots {
		walk(r, 0)
	}
}
