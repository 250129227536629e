package cluster_test

import (
	"context"
	"strings"
	"sync"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// faults makes chosen etcd calls of one client fail, as a loaded etcd does (a leader change, a
// request timing out): a test arms one fault, and the next call that matches it fails, once.
type faults struct {
	mu    sync.Mutex
	armed []*fault
}

// fault is one failure to come: the next call of method ("grant", "get", "put" or "txn") that
// touches a key starting with prefix (any grant). after: the call reaches etcd and commits, and its answer
// is lost on the way back.
type fault struct {
	method, prefix string
	after          bool
	fired          chan struct{}
}

// install puts the faults between c and etcd; call it before c is used.
func (f *faults) install(c *clientv3.Client) {
	c.KV = faultKV{KV: c.KV, f: f}
	c.Lease = faultLease{Lease: c.Lease, f: f}
}

// arm adds a fault; the channel returned is closed once it fired.
func (f *faults) arm(method, prefix string, after bool) <-chan struct{} {
	x := &fault{method: method, prefix: prefix, after: after, fired: make(chan struct{})}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.armed = append(f.armed, x)
	return x.fired
}

// take returns (and disarms) the first fault that matches a call of method on keys (any call
// of a method without keys).
func (f *faults) take(method string, keys ...[]byte) *fault {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, x := range f.armed {
		if x.method != method {
			continue
		}
		match := len(keys) == 0
		for _, k := range keys {
			match = match || strings.HasPrefix(string(k), x.prefix)
		}
		if match {
			f.armed = append(f.armed[:i], f.armed[i+1:]...)
			close(x.fired)
			return x
		}
	}
	return nil
}

var errInjected = rpctypes.ErrLeaderChanged

// run does call unless a fault of method on keys is armed: then it fails (after the call when
// the fault says so).
func run[T any](f *faults, method string, keys [][]byte, call func() (T, error)) (T, error) {
	x := f.take(method, keys...)
	if x == nil {
		return call()
	}
	var zero T
	if x.after {
		if _, err := call(); err != nil {
			return zero, err
		}
	}
	return zero, errInjected
}

type faultKV struct {
	clientv3.KV
	f *faults
}

func (kv faultKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	return run(kv.f, "get", [][]byte{[]byte(key)}, func() (*clientv3.GetResponse, error) { return kv.KV.Get(ctx, key, opts...) })
}

func (kv faultKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	return run(kv.f, "put", [][]byte{[]byte(key)}, func() (*clientv3.PutResponse, error) { return kv.KV.Put(ctx, key, val, opts...) })
}

func (kv faultKV) Txn(ctx context.Context) clientv3.Txn {
	return &faultTxn{Txn: kv.KV.Txn(ctx), f: kv.f}
}

// faultTxn notes the keys a transaction touches (its comparisons and operations).
type faultTxn struct {
	clientv3.Txn
	f    *faults
	keys [][]byte
}

func (t *faultTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	for i := range cs {
		t.keys = append(t.keys, cs[i].KeyBytes())
	}
	t.Txn = t.Txn.If(cs...)
	return t
}

func (t *faultTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.note(ops)
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *faultTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.note(ops)
	t.Txn = t.Txn.Else(ops...)
	return t
}

func (t *faultTxn) note(ops []clientv3.Op) {
	for _, op := range ops {
		t.keys = append(t.keys, op.KeyBytes())
	}
}

func (t *faultTxn) Commit() (*clientv3.TxnResponse, error) {
	return run(t.f, "txn", t.keys, t.Txn.Commit)
}

type faultLease struct {
	clientv3.Lease
	f *faults
}

func (l faultLease) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	return run(l.f, "grant", nil, func() (*clientv3.LeaseGrantResponse, error) { return l.Lease.Grant(ctx, ttl) })
}
