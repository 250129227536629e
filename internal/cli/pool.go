package cli

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// poolCmd is `ember pool`: the warm pools' state, and explicit warm-ups for workloads that know
// their concurrency.
func poolCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "pool", Short: "Show the warm pools and warm them up ahead of a known load"}
	ls := &cobra.Command{
		Use: "ls", Short: "Show the warm pools: ready, target, refills, demand and the memory budget", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return listPools(cmd.Context(), g) },
	}
	var wait bool
	var timeout time.Duration
	warm := &cobra.Command{
		Use:   "warm TEMPLATE N",
		Short: "Keep at least N restored sandboxes of TEMPLATE ready (0: follow demand alone)",
		Long: "Keep at least N restored sandboxes of TEMPLATE ready until told otherwise (0 returns the pool to\n" +
			"following demand alone). N may exceed --pool-max but not the pools' memory budget. With --wait,\n" +
			"return once the pool holds what fits.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			n, err := strconv.Atoi(args[1])
			if err != nil {
				return fmt.Errorf("the count %q is not a number", args[1])
			}
			var st sandbox.PoolState
			if _, err := g.client().do(cmd.Context(), http.MethodPost, "/ember/pools/"+url.PathEscape(args[0])+"/warm", map[string]any{"count": n}, &st); err != nil {
				return err
			}
			fits := n
			if st.InstanceMB > 0 && float64(n)*st.InstanceMB > float64(st.BudgetMB) {
				fits = int(float64(st.BudgetMB) / st.InstanceMB)
				fmt.Fprintf(os.Stderr, "warning: %d instances at %.1f MiB each exceed the pools' memory budget of %d MiB; about %d fit (--pool-memory-mb)\n", n, st.InstanceMB, st.BudgetMB, fits)
			}
			if wait {
				ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
				defer cancel()
				for st.Ready < min(fits, st.Target) {
					select {
					case <-ctx.Done():
						return fmt.Errorf("pool of %s: %d ready of %d after %s", st.TemplateID, st.Ready, fits, timeout)
					case <-time.After(200 * time.Millisecond):
					}
					var all []sandbox.PoolState
					if _, err := g.client().do(ctx, http.MethodGet, "/ember/pools", nil, &all); err != nil {
						return err
					}
					for _, p := range all {
						if p.TemplateID == st.TemplateID && p.Kind == st.Kind {
							st = p
						}
					}
				}
			}
			if g.asJSON {
				return printJSON(st)
			}
			fmt.Printf("pool of %s: warm %d, target %d, ready %d, refilling %d\n", st.TemplateID, st.Warm, st.Target, st.Ready, st.RefillsInFlight)
			return nil
		},
	}
	warm.Flags().BoolVar(&wait, "wait", false, "wait until the pool holds the instances that fit the budget")
	warm.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "how long --wait waits")
	c.AddCommand(ls, warm)
	return c
}

// listPools prints GET /ember/pools (`ember pool ls`, `ember template pools`).
func listPools(ctx context.Context, g *globals) error {
	var out []sandbox.PoolState
	if _, err := g.client().do(ctx, http.MethodGet, "/ember/pools", nil, &out); err != nil {
		return err
	}
	if out == nil {
		out = []sandbox.PoolState{}
	}
	if g.asJSON {
		return printJSON(out)
	}
	rows := [][]string{}
	for _, p := range out {
		rows = append(rows, []string{p.TemplateID, p.Kind, strconv.Itoa(p.Ready), strconv.Itoa(p.Target), strconv.Itoa(p.RefillsInFlight),
			fmt.Sprintf("%d-%d", p.Min, p.Max), warmCol(p.Warm), fmt.Sprintf("%.2f", p.CreateRate), fmt.Sprintf("%.1f", p.Burst),
			fmt.Sprintf("%.0f", p.RefillMs), strconv.Itoa(p.Hits), strconv.Itoa(p.Misses), fmt.Sprintf("%.1f", p.InstanceMB),
			fmt.Sprintf("%.0f/%d", p.UsedMB, p.BudgetMB)})
	}
	table([]string{"TEMPLATE", "KIND", "READY", "TARGET", "REFILLING", "RANGE", "WARM", "CREATES/S", "BURST", "REFILL MS", "HITS", "MISSES", "MIB EACH", "BUDGET MIB"}, rows)
	return nil
}

func warmCol(n int) string {
	if n == 0 {
		return "-"
	}
	return strconv.Itoa(n)
}
