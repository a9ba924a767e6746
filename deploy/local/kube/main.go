// One multi-call binary for the Kubernetes control plane of the local real cluster
// (gpuledger/dev/cluster.py): kube-apiserver, kube-controller-manager and kube-scheduler of the
// pinned release in go.mod. One binary, so the packages they share compile and link once.
//
//	kube kube-apiserver --etcd-servers=... ...
//
// (or a symlink named after a component). k8s.io/kubernetes cannot be `go install`ed (its go.mod
// has replace directives), hence this wrapper module.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var components = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := components[name]; !ok && len(os.Args) > 1 {
		// Called as `kube <component> [flags]`: the component sees itself as argv[0].
		name = os.Args[1]
		os.Args = append([]string{name}, os.Args[2:]...)
	}
	newCommand, ok := components[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "usage: kube {kube-apiserver|kube-controller-manager|kube-scheduler} [flags]\n")
		os.Exit(2)
	}
	os.Exit(cli.Run(newCommand()))
}
