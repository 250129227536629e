package cli

import (
	"fmt"
	"net/http"
	"net/url"

	"github.com/spf13/cobra"
)

func nodeCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "node", Short: "The nodes of a cluster: list, drain"}
	ls := &cobra.Command{
		Use: "ls", Short: "List the cluster's nodes (state, capacity, sandboxes routed there, lease age since its last renewal)", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out []map[string]any
			if _, err := g.client().do(cmd.Context(), http.MethodGet, "/nodes", nil, &out); err != nil {
				return err
			}
			if g.asJSON {
				if out == nil {
					out = []map[string]any{}
				}
				return printJSON(out)
			}
			rows := [][]string{}
			for _, n := range out {
				cp, _ := n["capacity"].(map[string]any)
				al, _ := n["allocated"].(map[string]any)
				sbxs, _ := n["sandboxes"].([]any)
				routes := fmt.Sprint(len(sbxs))
				if r, ok := n["routes"]; ok {
					routes = str(r)
				}
				lease := "-" // a node found dead has none
				if ttl, ok := n["leaseTTLSeconds"]; ok {
					lease = fmt.Sprintf("%ss/%ss", str(n["leaseAgeSeconds"]), str(ttl))
				}
				rows = append(rows, []string{str(n["nodeID"]), str(n["state"]), str(n["url"]),
					fmt.Sprintf("%s/%s", str(al["slots"]), str(cp["slots"])),
					fmt.Sprintf("%s/%s", str(al["memoryMB"]), str(cp["memoryMB"])),
					str(cp["cpu"]), routes, lease})
			}
			table([]string{"NODE", "STATE", "URL", "SLOTS", "MEMORY MB", "CPU", "ROUTES", "LEASE AGE/TTL"}, rows)
			return nil
		},
	}
	var undo bool
	drain := &cobra.Command{
		Use: "drain ID", Short: "Place no new sandboxes on a node (--undo: take new ones again)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			method := http.MethodPost
			if undo {
				method = http.MethodDelete
			}
			var out map[string]any
			if _, err := g.client().do(cmd.Context(), method, "/nodes/"+url.PathEscape(args[0])+"/drain", nil, &out); err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(out)
			}
			fmt.Println(args[0], str(out["state"]))
			return nil
		},
	}
	drain.Flags().BoolVar(&undo, "undo", false, "take new placements again")
	c.AddCommand(ls, drain)
	return c
}
