package cli

import (
	"fmt"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/ember-sandbox/ember/internal/tlsca"
)

// clusterCmd is `ember cluster`: what an operator sets a cluster up with.
func clusterCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "cluster", Short: "Set up a cluster: certificates for etcd and its nodes, the sealing key"}
	var dir, hosts, nodes string
	certs := &cobra.Command{
		Use:   "certs",
		Short: "Make (or complete) a cluster's CA, etcd's certificate, a client certificate per node and the sealing key",
		Long: `Make, in --dir, what an authenticated cluster store needs:
  ca.pem, ca-key.pem        the cluster CA (keep ca-key.pem off the nodes)
  etcd.pem, etcd-key.pem    etcd's server and peer certificate, for --hosts
  node-<id>.pem, -key.pem   each node's client certificate (ember serve --etcd-cert, --etcd-key)
  cluster-key.hex           the sealing key of the secrets ember keeps in etcd (--cluster-key-file)
Run it again with more --nodes to add nodes: what exists is kept (the sealing key always).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			res, err := tlsca.MakeCluster(tlsca.ClusterOptions{Dir: dir, Hosts: splitList(hosts), Nodes: splitList(nodes)})
			if err != nil {
				return err
			}
			if g.asJSON {
				return printJSON(map[string]any{"dir": dir, "written": res.Written, "kept": res.Kept})
			}
			out := cmd.OutOrStdout()
			for _, p := range res.Written {
				fmt.Fprintln(out, "wrote", p)
			}
			for _, p := range res.Kept {
				fmt.Fprintln(out, "kept ", p)
			}
			p := func(name string) string { return filepath.Join(dir, name) }
			fmt.Fprintf(out, "\netcd: --client-cert-auth --trusted-ca-file %s --cert-file %s --key-file %s\n", p(tlsca.ClusterCAFile), p(tlsca.EtcdCertFile), p(tlsca.EtcdKeyFile))
			fmt.Fprintf(out, "      (members > 1: --peer-client-cert-auth --peer-trusted-ca-file %s --peer-cert-file %s --peer-key-file %s)\n", p(tlsca.ClusterCAFile), p(tlsca.EtcdCertFile), p(tlsca.EtcdKeyFile))
			for _, n := range splitList(nodes) {
				fmt.Fprintf(out, "node %s: ember serve --node-id %s --etcd-endpoints https://... --etcd-ca %s --etcd-cert %s --etcd-key %s --cluster-key-file %s\n",
					n, n, p(tlsca.ClusterCAFile), p(tlsca.NodeCertFile(n)), p(tlsca.NodeKeyFile(n)), p(tlsca.ClusterSealingKey))
			}
			return nil
		},
	}
	certs.Flags().StringVar(&dir, "dir", "cluster-certs", "directory to write into (created 0700)")
	certs.Flags().StringVar(&hosts, "hosts", "localhost,127.0.0.1,::1", "names and IPs etcd's members are reached at (comma-separated)")
	certs.Flags().StringVar(&nodes, "nodes", "", "ember node ids to issue client certificates for (comma-separated)")
	c.AddCommand(certs)
	return c
}
