package gvisor

// SetMaxImportEntries changes the bound on an imported layer's entries for a test and returns a
// function that restores it.
func SetMaxImportEntries(n int) (restore func()) {
	old := maxImportEntries
	maxImportEntries = n
	return func() { maxImportEntries = old }
}
