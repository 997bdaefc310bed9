// CoreDNS with only the plugins the test cluster's Corefile uses: the upstream build links
// every plugin (cloud DNS providers among them), which costs minutes of compile on 2 cores.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order plugins see a query in (a subset of upstream's plugin.cfg, in its order).
func init() {
	dnsserver.Directives = []string{"errors", "health", "ready", "kubernetes", "cache", "forward"}
}

func main() { coremain.Run() }
