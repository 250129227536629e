package envd

import (
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// writeInfo is one entry of the POST /files response.
type writeInfo struct {
	Name     string            `json:"name"`
	Path     string            `json:"path"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// httpError is an error that carries its HTTP status.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func httpErrorf(status int, format string, args ...any) error {
	return &httpError{status: status, msg: fmt.Sprintf(format, args...)}
}

func writeHTTPError(w http.ResponseWriter, err error) {
	var he *httpError
	switch {
	case errors.As(err, &he):
		writeJSONError(w, he.status, he.msg)
	case errors.Is(err, syscall.ENOSPC):
		writeJSONError(w, http.StatusInsufficientStorage, "not enough disk space: "+err.Error())
	case errors.Is(err, errdefs.ErrInvalid):
		writeJSONError(w, http.StatusBadRequest, err.Error())
	case errors.Is(err, os.ErrNotExist):
		writeJSONError(w, http.StatusNotFound, err.Error())
	case errors.Is(err, os.ErrPermission):
		writeJSONError(w, http.StatusForbidden, err.Error())
	default:
		writeJSONError(w, http.StatusInternalServerError, err.Error())
	}
}

// filesAccount resolves the ?username= user, or the default user; unknown users are 401.
func (s *Server) filesAccount(r *http.Request) (*account, error) {
	name := r.URL.Query().Get("username")
	if name == "" {
		name = s.settings().defaultUser
	}
	acct, err := lookupAccount(name)
	if err != nil {
		return nil, httpErrorf(http.StatusUnauthorized, "error looking up user '%s': user: unknown user %s", name, name)
	}
	return acct, nil
}

// getFile serves GET /files?path=: the raw bytes of a regular file.
func (s *Server) getFile(w http.ResponseWriter, r *http.Request) {
	acct, err := s.filesAccount(r)
	if err != nil {
		writeHTTPError(w, err)
		return
	}
	raw := r.URL.Query().Get("path")
	if raw == "" {
		writeJSONError(w, http.StatusBadRequest, "path is required")
		return
	}
	path := acct.resolvePath(raw)
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			writeJSONError(w, http.StatusNotFound, fmt.Sprintf("path '%s' does not exist", path))
			return
		}
		writeHTTPError(w, err)
		return
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		writeHTTPError(w, err)
		return
	}
	if fi.IsDir() {
		writeJSONError(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is a directory", path))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": fi.Name()}))
	if seekable(f, fi) {
		http.ServeContent(w, r, "", fi.ModTime(), f) // ranges, conditional requests
		return
	}
	streamFile(w, f)
}

// seekable: a regular file whose size is its content. Pseudo filesystems report 0 or a page
// size for generated files, and some of them cannot seek at all ("seeker can't seek").
func seekable(f *os.File, fi os.FileInfo) bool {
	if !fi.Mode().IsRegular() || fi.Size() == 0 {
		return false
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &st); err == nil && (st.Type == unix.PROC_SUPER_MAGIC || st.Type == unix.SYSFS_MAGIC) {
		return false
	}
	if _, err := f.Seek(0, io.SeekEnd); err != nil {
		return false
	}
	_, err := f.Seek(0, io.SeekStart)
	return err == nil
}

// streamFile sends what it can read from f without seeking: procfs and sysfs files (size 0 or
// a made-up size, often not seekable), fifos, character devices. An empty read gives
// Content-Length: 0, which the SDKs need to return an empty file; anything else is streamed.
func streamFile(w http.ResponseWriter, f *os.File) {
	buf := make([]byte, 32<<10)
	n, err := f.Read(buf)
	if n == 0 && err != nil && err != io.EOF {
		writeHTTPError(w, fmt.Errorf("read %s: %w", f.Name(), err))
		return
	}
	if n == 0 {
		w.Header().Set("Content-Length", "0")
		w.WriteHeader(http.StatusOK)
		return
	}
	w.WriteHeader(http.StatusOK)
	if _, err := w.Write(buf[:n]); err != nil {
		return
	}
	_, _ = io.CopyBuffer(w, f, buf)
}

// postFiles serves POST /files: multipart parts named "file", or an octet-stream body with ?path=.
func (s *Server) postFiles(w http.ResponseWriter, r *http.Request) {
	acct, err := s.filesAccount(r)
	if err != nil {
		writeHTTPError(w, err)
		return
	}
	queryPath := r.URL.Query().Get("path")
	// X-Metadata-* headers (envd >= 0.6.2) become the metadata of every file of the request; no
	// header means none, so an overwrite clears what an earlier upload stored.
	md := metadataFromHeaders(r.Header)
	if err := validateMetadata(md); err != nil {
		writeHTTPError(w, err)
		return
	}
	mediaType, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var written []writeInfo

	switch mediaType {
	case "multipart/form-data":
		mr, err := r.MultipartReader()
		if err != nil {
			writeJSONError(w, http.StatusBadRequest, "invalid multipart body: "+err.Error())
			return
		}
		for {
			part, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				writeJSONError(w, http.StatusBadRequest, "invalid multipart body: "+err.Error())
				return
			}
			if part.FormName() != "file" {
				part.Close()
				continue
			}
			// part.FileName() strips directories; the SDK puts the destination path there.
			_, params, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
			dest := params["filename"]
			if queryPath != "" {
				dest = queryPath
			}
			if dest == "" {
				part.Close()
				writeJSONError(w, http.StatusBadRequest, "a file part has no filename and the request no path")
				return
			}
			info, err := s.writeFileWatched(acct, acct.resolvePath(dest), part, md)
			part.Close()
			if err != nil {
				writeHTTPError(w, err)
				return
			}
			written = append(written, info)
		}
	default: // application/octet-stream and anything else: the body is the file
		if queryPath == "" {
			writeJSONError(w, http.StatusBadRequest, "path query parameter is required for raw body upload")
			return
		}
		var body io.Reader = r.Body
		if strings.EqualFold(r.Header.Get("Content-Encoding"), "gzip") {
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				writeJSONError(w, http.StatusBadRequest, "error decompressing request body: "+err.Error())
				return
			}
			defer zr.Close()
			body = zr
		}
		info, err := s.writeFileWatched(acct, acct.resolvePath(queryPath), body, md)
		if err != nil {
			writeHTTPError(w, err)
			return
		}
		written = append(written, info)
	}
	if len(written) == 0 {
		writeJSONError(w, http.StatusBadRequest, "no file in the request")
		return
	}
	writeJSON(w, http.StatusOK, written)
}

// writeFileWatched is writeFileAs, answered once the polling watchers of path's directory have
// taken in the write (watcherRegistry.expectWrite).
func (s *Server) writeFileWatched(acct *account, path string, body io.Reader, md map[string]string) (writeInfo, error) {
	wait := s.watchers.expectWrite(path)
	info, err := writeFileAs(acct, path, body, md)
	wait(err == nil)
	return info, err
}

// writeFileAs streams body to path (creating parents, replacing the file) owned by acct, and
// makes md the file's whole metadata.
func writeFileAs(acct *account, path string, body io.Reader, md map[string]string) (writeInfo, error) {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return writeInfo{}, httpErrorf(http.StatusBadRequest, "path is a directory: %s", path)
	}
	if err := mkdirAllAs(filepath.Dir(path), acct); err != nil {
		if errors.Is(err, errdefs.ErrInvalid) {
			return writeInfo{}, httpErrorf(http.StatusBadRequest, "%s", err.Error())
		}
		return writeInfo{}, err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return writeInfo{}, err
	}
	if _, err := io.Copy(f, body); err != nil {
		f.Close()
		if errors.Is(err, syscall.ENOSPC) {
			return writeInfo{}, err
		}
		return writeInfo{}, httpErrorf(http.StatusBadRequest, "reading upload of '%s': %v", path, err)
	}
	if err := f.Chown(int(acct.UID), int(acct.GID)); err != nil {
		f.Close()
		return writeInfo{}, err
	}
	if err := replaceMetadata(f, md); err != nil {
		f.Close()
		return writeInfo{}, err
	}
	if err := f.Close(); err != nil {
		return writeInfo{}, err
	}
	return writeInfo{Name: filepath.Base(path), Path: path, Type: "file", Metadata: md}, nil
}
