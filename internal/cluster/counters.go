package cluster

import (
	"context"
	"path"
	"sync"

	"google.golang.org/grpc"
)

// EtcdCounters counts the requests one etcd client sends, by kind (Range, Txn, Put,
// DeleteRange, LeaseGrant, LeaseKeepAlive, Watch, ...: the gRPC method's name), for /metrics.
// Give its DialOptions to the client's config and the same value to Config.Counters.
type EtcdCounters struct {
	mu sync.Mutex
	n  map[string]int64
}

// NewEtcdCounters returns counters at zero.
func NewEtcdCounters() *EtcdCounters { return &EtcdCounters{n: map[string]int64{}} }

// DialOptions counts every unary call and every stream the client opens.
func (c *EtcdCounters) DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			c.add(method)
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			c.add(method)
			return streamer(ctx, desc, cc, method, opts...)
		}),
	}
}

func (c *EtcdCounters) add(method string) {
	c.mu.Lock()
	c.n[path.Base(method)]++
	c.mu.Unlock()
}

// Requests returns the counts so far by kind.
func (c *EtcdCounters) Requests() map[string]int64 {
	out := map[string]int64{}
	if c == nil {
		return out
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, v := range c.n {
		out[k] = v
	}
	return out
}

// EtcdRequests returns the requests this node's etcd client sent, by kind (empty without
// Config.Counters).
func (cl *Cluster) EtcdRequests() map[string]int64 { return cl.cfg.Counters.Requests() }

// WatchEvents counts the watch events this node received.
func (cl *Cluster) WatchEvents() int64 { return cl.watchEvents.Load() }
