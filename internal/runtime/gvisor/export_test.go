package gvisor

import "context"

// SetMaxImportEntries changes the bound on an imported layer's entries for a test and returns a
// function that restores it.
func SetMaxImportEntries(n int) (restore func()) {
	old := maxImportEntries
	maxImportEntries = n
	return func() { maxImportEntries = old }
}

// NetworkConfig is the network the sentry of instance id holds (containerManager.GetNetworkConfig),
// as JSON.
func (d *Driver) NetworkConfig(ctx context.Context, id string) (map[string]any, error) {
	var out map[string]any
	err := d.ctlCall(ctx, id, "", ctlNetworkConfig, &struct{}{}, &out)
	return out, err
}
