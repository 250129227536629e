package sandbox

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/envdclient"
)

// The node's egress proxy terminates TLS to the hosts a sandbox has rules for with
// certificates of the node's egress CA (internal/egress). A sandbox with rules trusts that CA:
// at its first start (and when updateNetwork gives it rules) the CA's certificate is appended,
// as root through envd, to the system bundle /etc/ssl/certs/ca-certificates.crt (what curl,
// wget, OpenSSL and Go read), and the variables that point the other TLS stacks at that bundle
// are set in envd's environment (caEnv: Python's ssl and requests/certifi, Node, curl), except
// those the sandbox's own env vars set. The certificate is public; its key never leaves the
// node.

// egressCAMarker starts the appended block, so it is appended once.
const egressCAMarker = "# ember egress CA"

// caBundle is the trust store the CA goes into.
const caBundle = "/etc/ssl/certs/ca-certificates.crt"

// caEnv are the variables that make TLS clients with bundles of their own trust caBundle.
var caEnv = []string{"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE"}

// trustEgressCA installs Config.EgressCA in sb when its rules need it (a no-op otherwise).
func (m *Manager) trustEgressCA(ctx context.Context, client *http.Client, base string, sb *Sandbox) error {
	if len(m.cfg.EgressCA) == 0 || len(sb.Egress().Rules) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	line := fmt.Sprintf(`grep -qF %q %s 2>/dev/null || { mkdir -p /etc/ssl/certs && printf '\n%%s\n%%s' %q "$EMBER_EGRESS_CA" >> %s; }`,
		egressCAMarker, caBundle, egressCAMarker, caBundle)
	var out strings.Builder
	res, err := envdclient.New(client, base, sb.AccessToken).Run(ctx, envdclient.Command{Line: line, User: "root",
		Envs: map[string]string{"EMBER_EGRESS_CA": string(m.cfg.EgressCA)}}, envdclient.Collect(&out))
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("exit %d: %s", res.ExitCode, strings.TrimSpace(out.String()))
	}
	if err == nil {
		env := map[string]string{}
		for _, k := range caEnv {
			if _, set := sb.EnvVars[k]; !set {
				env[k] = caBundle
			}
		}
		err = envdclient.New(client, base, sb.AccessToken).SetEnvVars(ctx, env)
	}
	if err != nil {
		return fmt.Errorf("install the egress CA in sandbox %s: %w", sb.ID, err)
	}
	return nil
}
