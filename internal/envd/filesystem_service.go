package envd

import (
	"context"
	"errors"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"syscall"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/ember-sandbox/ember/api/gen/filesystem"
	"github.com/ember-sandbox/ember/api/gen/filesystem/filesystemconnect"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// filesystemService implements filesystem.Filesystem.
type filesystemService struct{ s *Server }

var _ filesystemconnect.FilesystemHandler = (*filesystemService)(nil)

// fsAccount resolves the acting user of a filesystem RPC; an unknown user is unauthenticated.
func (f *filesystemService) fsAccount(h http.Header) (*account, error) {
	name, err := basicUser(h)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, err)
	}
	if name == "" {
		name = f.s.settings().defaultUser
	}
	acct, err := lookupAccount(name)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, errorf(errdefs.ErrUnauthorized, "invalid username: '%s'", name))
	}
	return acct, nil
}

// entryInfo describes path (not following a final symlink: a link is described as E2B's envd
// does, see entryFromInfo).
func entryInfo(path string, names *nameCache) (*pb.EntryInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	return entryFromInfo(path, fi, names), nil
}

// entryFromInfo builds the EntryInfo of path from its lstat result. A symlink is reported as
// E2B's envd reports it: symlink_target is the fully resolved absolute path (a relative link
// resolves against the link's directory), and type and mode are the target's, because E2B's
// SDKs know no symlink type on the wire (the Python SDK cannot parse FILE_TYPE_SYMLINK). A
// dangling link has type UNSPECIFIED (the SDKs skip such entries in listings) and keeps its own
// path as the target. Name, path, size, permissions, owner and time stay the link's own.
func entryFromInfo(path string, fi fs.FileInfo, names *nameCache) *pb.EntryInfo {
	e := &pb.EntryInfo{
		Name:         fi.Name(),
		Path:         path,
		Size:         fi.Size(),
		Mode:         uint32(fi.Mode().Perm()),
		Permissions:  fi.Mode().String(),
		ModifiedTime: timestamppb.New(fi.ModTime()),
		Type:         fileType(fi.Mode()),
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		target := path
		e.Type, e.Mode = pb.FileType_FILE_TYPE_UNSPECIFIED, 0
		if resolved, err := filepath.EvalSymlinks(path); err == nil {
			target = resolved
			if ti, err := os.Stat(resolved); err == nil {
				e.Type, e.Mode = fileType(ti.Mode()), uint32(ti.Mode().Perm())
			}
		}
		e.SymlinkTarget = &target
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		e.Owner = names.user(st.Uid)
		e.Group = names.group(st.Gid)
	}
	e.Metadata = readMetadata(path)
	return e
}

// fileType maps a mode to the wire type as E2B's envd does: regular files and directories;
// anything else (devices, fifos, sockets, a symlink's own mode) is UNSPECIFIED, which the SDKs
// leave out of listings.
func fileType(m fs.FileMode) pb.FileType {
	switch {
	case m.IsRegular():
		return pb.FileType_FILE_TYPE_FILE
	case m.IsDir():
		return pb.FileType_FILE_TYPE_DIRECTORY
	default:
		return pb.FileType_FILE_TYPE_UNSPECIFIED
	}
}

// fsError translates a filesystem error; a missing path is not_found with E2B envd's wording for
// the RPC: what (e.g. "file not found") followed by the OS error ("lstat /x: no such file or
// directory").
func fsError(what string, err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return connect.NewError(connect.CodeNotFound, errorf(errdefs.ErrNotFound, "%s: %v", what, err))
	}
	return toConnectError(err)
}

func (f *filesystemService) Stat(_ context.Context, req *connect.Request[pb.StatRequest]) (*connect.Response[pb.StatResponse], error) {
	acct, err := f.fsAccount(req.Header())
	if err != nil {
		return nil, err
	}
	path := acct.resolvePath(req.Msg.GetPath())
	e, err := entryInfo(path, newNameCache())
	if err != nil {
		return nil, fsError("file not found", err)
	}
	return connect.NewResponse(&pb.StatResponse{Entry: e}), nil
}

// mkdirAllAs creates dir and its missing parents, giving the new ones to acct.
func mkdirAllAs(dir string, acct *account) error {
	if fi, err := os.Stat(dir); err == nil {
		if fi.IsDir() {
			return nil
		}
		return errorf(errdefs.ErrInvalid, "path '%s' exists and is not a directory", dir)
	}
	parent := filepath.Dir(dir)
	if parent != dir {
		if err := mkdirAllAs(parent, acct); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		if errors.Is(err, os.ErrExist) {
			return nil
		}
		return err
	}
	return os.Lchown(dir, int(acct.UID), int(acct.GID))
}

func (f *filesystemService) MakeDir(_ context.Context, req *connect.Request[pb.MakeDirRequest]) (*connect.Response[pb.MakeDirResponse], error) {
	acct, err := f.fsAccount(req.Header())
	if err != nil {
		return nil, err
	}
	path := acct.resolvePath(req.Msg.GetPath())
	// As E2B's envd: an existing directory is already_exists (makeDir() returns false), anything
	// else in the way is invalid_argument.
	if fi, err := os.Stat(path); err == nil {
		if fi.IsDir() {
			return nil, connect.NewError(connect.CodeAlreadyExists, errorf(errdefs.ErrConflict, "directory already exists: %s", path))
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, errorf(errdefs.ErrInvalid, "path already exists but it is not a directory: %s", path))
	}
	if err := mkdirAllAs(path, acct); err != nil {
		return nil, fsError("parent directory not found", err)
	}
	e, err := entryInfo(path, newNameCache())
	if err != nil {
		return nil, fsError("directory not found", err)
	}
	return connect.NewResponse(&pb.MakeDirResponse{Entry: e}), nil
}

func (f *filesystemService) Move(_ context.Context, req *connect.Request[pb.MoveRequest]) (*connect.Response[pb.MoveResponse], error) {
	acct, err := f.fsAccount(req.Header())
	if err != nil {
		return nil, err
	}
	src := acct.resolvePath(req.Msg.GetSource())
	dst := acct.resolvePath(req.Msg.GetDestination())
	if _, err := os.Lstat(src); err != nil {
		return nil, fsError("source file not found", err)
	}
	if err := mkdirAllAs(filepath.Dir(dst), acct); err != nil {
		return nil, fsError("destination directory not found", err)
	}
	if err := os.Rename(src, dst); err != nil {
		return nil, fsError("source file not found", err)
	}
	e, err := entryInfo(dst, newNameCache())
	if err != nil {
		return nil, fsError("file not found", err)
	}
	return connect.NewResponse(&pb.MoveResponse{Entry: e}), nil
}

func (f *filesystemService) ListDir(_ context.Context, req *connect.Request[pb.ListDirRequest]) (*connect.Response[pb.ListDirResponse], error) {
	acct, err := f.fsAccount(req.Header())
	if err != nil {
		return nil, err
	}
	root := acct.resolvePath(req.Msg.GetPath())
	depth := int(req.Msg.GetDepth())
	if depth < 1 {
		depth = 1
	}
	fi, err := os.Stat(root) // follows a symlinked directory
	if err != nil {
		return nil, fsError("path not found", err)
	}
	if !fi.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, errorf(errdefs.ErrInvalid, "path is not a directory: %s", root))
	}
	names := newNameCache()
	var entries []*pb.EntryInfo
	var walk func(dir string, level int) error
	walk = func(dir string, level int) error {
		des, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, de := range des {
			p := filepath.Join(dir, de.Name())
			info, err := de.Info()
			if err != nil {
				continue // removed meanwhile
			}
			entries = append(entries, entryFromInfo(p, info, names))
			if info.IsDir() && level < depth {
				if err := walk(p, level+1); err != nil && !errors.Is(err, os.ErrNotExist) && !errors.Is(err, os.ErrPermission) {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(root, 1); err != nil {
		return nil, fsError("path not found", err)
	}
	return connect.NewResponse(&pb.ListDirResponse{Entries: entries}), nil
}

func (f *filesystemService) Remove(_ context.Context, req *connect.Request[pb.RemoveRequest]) (*connect.Response[pb.RemoveResponse], error) {
	acct, err := f.fsAccount(req.Header())
	if err != nil {
		return nil, err
	}
	path := acct.resolvePath(req.Msg.GetPath())
	// Removing what is not there succeeds, as E2B's envd does now (os.RemoveAll semantics).
	if err := os.RemoveAll(path); err != nil {
		return nil, toConnectError(err)
	}
	return connect.NewResponse(&pb.RemoveResponse{}), nil
}
