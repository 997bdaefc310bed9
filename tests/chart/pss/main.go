// pss-check evaluates pod templates against a Pod Security Standards level with the
// Kubernetes project's own checks (k8s.io/pod-security-admission/policy, the code the
// PodSecurity admission plugin runs), so the chart tests judge rendered pods by the
// standard itself rather than by a restatement of it.
//
// Input (stdin): a JSON list of {"name": ..., "level": "baseline|restricted",
// "template": <PodTemplateSpec>}. Output (stdout): a JSON list of {"name", "level",
// "allowed", "violations": ["<reason>: <detail>", ...]}.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
)

type request struct {
	Name     string                 `json:"name"`
	Level    string                 `json:"level"`
	Template corev1.PodTemplateSpec `json:"template"`
}

type verdict struct {
	Name       string   `json:"name"`
	Level      string   `json:"level"`
	Allowed    bool     `json:"allowed"`
	Violations []string `json:"violations"`
}

func main() {
	var requests []request
	if err := json.NewDecoder(os.Stdin).Decode(&requests); err != nil {
		fmt.Fprintln(os.Stderr, "pss-check: reading the input:", err)
		os.Exit(2)
	}
	evaluator, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pss-check:", err)
		os.Exit(2)
	}
	verdicts := []verdict{}
	for _, r := range requests {
		level, err := api.ParseLevel(r.Level)
		if err != nil {
			fmt.Fprintln(os.Stderr, "pss-check:", err)
			os.Exit(2)
		}
		lv := api.LevelVersion{Level: level, Version: api.LatestVersion()}
		result := policy.AggregateCheckResults(evaluator.EvaluatePod(lv, &r.Template.ObjectMeta, &r.Template.Spec))
		v := verdict{Name: r.Name, Level: r.Level, Allowed: result.Allowed, Violations: []string{}}
		for i, reason := range result.ForbiddenReasons {
			v.Violations = append(v.Violations, reason+": "+result.ForbiddenDetails[i])
		}
		verdicts = append(verdicts, v)
	}
	if err := json.NewEncoder(os.Stdout).Encode(verdicts); err != nil {
		fmt.Fprintln(os.Stderr, "pss-check: writing the output:", err)
		os.Exit(2)
	}
}
