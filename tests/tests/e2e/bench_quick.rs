//! The benchmark harness's CI mode: random vs Switchyard on a small shared-prefix workload,
//! checking only what timing cannot flake: the prefix-cache hit rate.

use switchyard_e2e::process::binary;

#[test]
fn cache_aware_routing_multiplies_the_prefix_cache_hit_rate() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("quick.json");
    // The bench starts switchyard-sim and switchyard-proxy from its own directory.
    let _ = binary("switchyard-proxy");
    let output = std::process::Command::new(binary("switchyard-bench"))
        .args(["compare", "--quick", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "quick bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("quick check passed"), "{stdout}");
    // Output that is not a terminal (a CI log, `> file`) gets plain lines, no progress frames.
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stdout.contains('\r') && !stderr.contains('\r'),
        "carriage returns in redirected output:\n{stdout:?}\n{stderr:?}"
    );
    assert!(
        stdout
            .lines()
            .any(|line| line.contains("switchyard") && line.contains("48 requests, 0 errors")),
        "no per-run line in:\n{stdout}"
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let results = report["shared-prefix"]["results"].as_array().unwrap();
    let hit = |name: &str| {
        results.iter().find(|r| r["router"] == name).unwrap()["cache_hit_rate"]
            .as_f64()
            .unwrap()
    };
    assert!(hit("switchyard") >= 1.5 * hit("random"), "{report}");
    assert!(
        dir.path().join("ttft-cdf-shared-prefix.png").exists(),
        "the TTFT CDF plot was not written:\n{stdout}"
    );
    for result in results {
        assert_eq!(result["errors"], 0, "{result}");
        assert_eq!(result["requests"], 48, "{result}");
    }
}
