// Package s3 is the snapshot store's Backend on S3-compatible object storage (AWS S3, MinIO,
// Ceph RGW, SeaweedFS, ...), through the minio-go client. An S3 PUT is atomic, so an object is
// complete or absent; with Store's manifest-last order a snapshot on S3 is complete or absent
// too. It owns the objects under its bucket and prefix, nothing else.
package s3

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
)

// Config says where the bucket is and how to reach it.
type Config struct {
	Endpoint     string // host[:port], no scheme
	Bucket       string
	Prefix       string // optional key prefix inside the bucket, e.g. "ember/"
	AccessKey    string
	SecretKey    string
	SessionToken string
	Region       string // default "us-east-1"
	TLS          bool   // https
	CAFile       string // PEM file of extra CAs to trust (TLS only)
	// InsecureSkipVerify disables certificate checks; for tests only.
	InsecureSkipVerify bool
	// PathStyle forces path-style requests (http://host/bucket/key), which most self-hosted
	// servers need; otherwise the client chooses.
	PathStyle bool
	// MaxRetries bounds the client's retries of a failed request (0: minio-go's default, 10,
	// with backoff).
	MaxRetries int
}

// Validate checks the config, naming the bad field.
func (c Config) Validate() error {
	switch {
	case c.Endpoint == "":
		return fmt.Errorf("s3.endpoint: required: %w", errdefs.ErrInvalid)
	case strings.Contains(c.Endpoint, "://"):
		return fmt.Errorf("s3.endpoint: %q: give host:port without scheme (set s3.tls for https): %w", c.Endpoint, errdefs.ErrInvalid)
	case c.Bucket == "":
		return fmt.Errorf("s3.bucket: required: %w", errdefs.ErrInvalid)
	case c.Prefix != "" && snapshot.ValidateKey(strings.TrimSuffix(c.Prefix, "/")) != nil:
		return fmt.Errorf("s3.prefix: %q: %w", c.Prefix, errdefs.ErrInvalid)
	case c.CAFile != "" && !c.TLS:
		return fmt.Errorf("s3.ca_file: set but s3.tls is off: %w", errdefs.ErrInvalid)
	}
	return nil
}

// Backend stores blobs as objects in one bucket.
type Backend struct {
	client *minio.Client
	bucket string
	prefix string
	region string

	bucketSeen atomic.Bool // the bucket answered once, so a 404 on HEAD means a missing key
}

var (
	_ snapshot.Backend = (*Backend)(nil)
	_ snapshot.Creator = (*Backend)(nil)
)

// New returns a Backend for cfg. It does not contact the server; see EnsureBucket.
func New(cfg Config) (*Backend, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Region == "" {
		cfg.Region = "us-east-1"
	}
	tr, err := minio.DefaultTransport(cfg.TLS)
	if err != nil {
		return nil, err
	}
	if cfg.TLS {
		tc := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: cfg.InsecureSkipVerify}
		if cfg.CAFile != "" {
			pem, err := os.ReadFile(cfg.CAFile)
			if err != nil {
				return nil, fmt.Errorf("s3.ca_file: %w", err)
			}
			pool, err := x509.SystemCertPool()
			if err != nil {
				pool = x509.NewCertPool()
			}
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("s3.ca_file: %s: no PEM certificates: %w", cfg.CAFile, errdefs.ErrInvalid)
			}
			tc.RootCAs = pool
		}
		tr.TLSClientConfig = tc
	}
	lookup := minio.BucketLookupAuto
	if cfg.PathStyle {
		lookup = minio.BucketLookupPath
	}
	client, err := minio.New(cfg.Endpoint, &minio.Options{
		Creds:        credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, cfg.SessionToken),
		Secure:       cfg.TLS,
		Transport:    tr,
		Region:       cfg.Region,
		BucketLookup: lookup,
		MaxRetries:   cfg.MaxRetries,
	})
	if err != nil {
		return nil, fmt.Errorf("s3: %v: %w", err, errdefs.ErrInvalid)
	}
	prefix := cfg.Prefix
	if prefix != "" && !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	return &Backend{client: client, bucket: cfg.Bucket, prefix: prefix, region: cfg.Region}, nil
}

// EnsureBucket creates the bucket if it does not exist.
func (b *Backend) EnsureBucket(ctx context.Context) error {
	ok, err := b.client.BucketExists(ctx, b.bucket)
	if err != nil {
		return b.wrap("bucket "+b.bucket, err)
	}
	if ok {
		return nil
	}
	if err := b.client.MakeBucket(ctx, b.bucket, minio.MakeBucketOptions{Region: b.region}); err != nil {
		if code := minio.ToErrorResponse(err).Code; code == "BucketAlreadyOwnedByYou" || code == "BucketAlreadyExists" {
			return nil
		}
		return b.wrap("bucket "+b.bucket, err)
	}
	return nil
}

func (b *Backend) object(key string) (string, error) {
	if err := snapshot.ValidateKey(key); err != nil {
		return "", err
	}
	return b.prefix + key, nil
}

// Put implements snapshot.Backend.
func (b *Backend) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	return b.put(ctx, key, r, size, false)
}

// Create implements snapshot.Creator with a conditional PUT (If-None-Match: *), which AWS S3,
// MinIO and versitygw evaluate atomically; the server's 412 is ErrConflict.
func (b *Backend) Create(ctx context.Context, key string, r io.Reader, size int64) error {
	return b.put(ctx, key, r, size, true)
}

func (b *Backend) put(ctx context.Context, key string, r io.Reader, size int64, exclusive bool) error {
	name, err := b.object(key)
	if err != nil {
		return err
	}
	opts := minio.PutObjectOptions{
		// No Content-MD5: over http minio-go signs every 64 KiB of the body (streaming SigV4),
		// over https TLS protects it, and Load verifies each chunk's sha256 anyway.
		ContentType: "application/octet-stream",
	}
	op := "put "
	if exclusive {
		opts.SetMatchETagExcept("*")
		opts.DisableMultipart = true // one request, so the condition covers the whole object
		op = "create "
	}
	er := &exactReader{r: r, left: size}
	_, err = b.client.PutObject(ctx, b.bucket, name, er, size, opts)
	if er.err != nil {
		return fmt.Errorf("%s%s: %w", op, key, er.err)
	}
	if err != nil {
		return b.wrap(op+key, err)
	}
	return nil
}

// Get implements snapshot.Backend.
func (b *Backend) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	name, err := b.object(key)
	if err != nil {
		return nil, err
	}
	obj, err := b.client.GetObject(ctx, b.bucket, name, minio.GetObjectOptions{})
	if err != nil {
		return nil, b.wrap("get "+key, err)
	}
	if _, err := obj.Stat(); err != nil { // GetObject is lazy; this sends the request
		obj.Close()
		return nil, b.wrap("get "+key, err)
	}
	return obj, nil
}

// Exists implements snapshot.Backend.
func (b *Backend) Exists(ctx context.Context, key string) (bool, error) {
	name, err := b.object(key)
	if err != nil {
		return false, err
	}
	_, err = b.client.StatObject(ctx, b.bucket, name, minio.StatObjectOptions{})
	if err == nil {
		return true, nil
	}
	if err = b.wrap("stat "+key, err); !errors.Is(err, errdefs.ErrNotFound) || isBucketMissing(err) {
		return false, err
	}
	// A HEAD response has no body, so a missing bucket looks like a missing key; ask once.
	if !b.bucketSeen.Load() {
		ok, err := b.client.BucketExists(ctx, b.bucket)
		if err != nil {
			return false, b.wrap("bucket "+b.bucket, err)
		}
		if !ok {
			return false, fmt.Errorf("s3 stat %s: bucket %q does not exist: %w", key, b.bucket, errdefs.ErrNotFound)
		}
		b.bucketSeen.Store(true)
	}
	return false, nil
}

// Delete implements snapshot.Backend.
func (b *Backend) Delete(ctx context.Context, key string) error {
	name, err := b.object(key)
	if err != nil {
		return err
	}
	if err := b.client.RemoveObject(ctx, b.bucket, name, minio.RemoveObjectOptions{}); err != nil {
		if err = b.wrap("delete "+key, err); errors.Is(err, errdefs.ErrNotFound) && !isBucketMissing(err) {
			return nil
		}
		return err
	}
	return nil
}

// List implements snapshot.Backend.
func (b *Backend) List(ctx context.Context, prefix string) ([]string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var keys []string
	for obj := range b.client.ListObjects(ctx, b.bucket, minio.ListObjectsOptions{Prefix: b.prefix + prefix, Recursive: true}) {
		if obj.Err != nil {
			return nil, b.wrap("list "+prefix, obj.Err)
		}
		keys = append(keys, strings.TrimPrefix(obj.Key, b.prefix))
	}
	return keys, nil
}

type bucketMissing struct{ error }

func (e bucketMissing) Unwrap() error { return e.error }

func isBucketMissing(err error) bool {
	var bm bucketMissing
	return errors.As(err, &bm)
}

// wrap puts an S3 error into ember's categories.
func (b *Backend) wrap(what string, err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("s3 %s: %w", what, err)
	}
	resp := minio.ToErrorResponse(err)
	switch resp.Code {
	case "NoSuchKey":
		return fmt.Errorf("s3 %s: %w", what, errdefs.ErrNotFound)
	case "NoSuchBucket":
		return bucketMissing{fmt.Errorf("s3 %s: bucket %q does not exist: %w", what, b.bucket, errdefs.ErrNotFound)}
	case "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
		"XAdminUserNotFound": // versitygw's answer for an unknown access key
		return fmt.Errorf("s3 %s: %s: %w", what, resp.Message, errdefs.ErrUnauthorized)
	case "PreconditionFailed":
		return fmt.Errorf("s3 %s: already exists: %w", what, errdefs.ErrConflict)
	case "BadDigest", "IncompleteBody", "InvalidDigest":
		return fmt.Errorf("s3 %s: %s: %w", what, resp.Message, errdefs.ErrCorrupt)
	}
	var ne net.Error
	if errors.As(err, &ne) || resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode >= 500 {
		return fmt.Errorf("s3 %s: %v: %w", what, err, errdefs.ErrUnavailable)
	}
	if resp.StatusCode == http.StatusPreconditionFailed {
		return fmt.Errorf("s3 %s: already exists: %w", what, errdefs.ErrConflict)
	}
	if resp.StatusCode == http.StatusNotFound {
		return fmt.Errorf("s3 %s: %w", what, errdefs.ErrNotFound)
	}
	return fmt.Errorf("s3 %s: %w", what, err)
}

// exactReader fails the upload if r yields more or fewer than left bytes, before the last
// byte is handed to the client, so a wrong-sized body never becomes an object.
type exactReader struct {
	r    io.Reader
	left int64
	err  error
}

func (e *exactReader) Read(p []byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	if e.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > e.left {
		p = p[:e.left]
	}
	n, err := e.r.Read(p)
	e.left -= int64(n)
	if e.left == 0 {
		var one [1]byte
		if k, _ := io.ReadFull(e.r, one[:]); k > 0 {
			e.err = fmt.Errorf("reader longer than the declared size: %w", errdefs.ErrInvalid)
			return 0, e.err
		}
		return n, io.EOF
	}
	if errors.Is(err, io.EOF) {
		e.err = fmt.Errorf("reader short by %d bytes: %w", e.left, errdefs.ErrInvalid)
		return n, e.err
	}
	return n, err
}
