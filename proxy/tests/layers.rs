//! The proxy's modules import each other in one direction only: data (worker state, KV state)
//! below routing, below configuration, below the background feeds and the request's phases.
//! A `crate::x` path in a module's code (comments and test modules aside) is an edge; the test
//! fails with the cycle it finds.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Edges of the module graph: module → modules its code names.
fn module_graph() -> std::io::Result<BTreeMap<String, BTreeSet<String>>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = vec![src.clone()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                files.push(entry?.path());
            }
            continue;
        }
        let is_rust = path.extension().is_some_and(|e| e == "rs");
        if !is_rust || path.file_name().is_some_and(|name| name == "tests.rs") {
            continue;
        }
        // A file under `src/x/` belongs to module `x`.
        let Some(first) = path
            .strip_prefix(&src)
            .ok()
            .and_then(|relative| relative.components().next())
        else {
            continue;
        };
        let module = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        let code = text
            .split("#[cfg(test)]\nmod tests {")
            .next()
            .unwrap_or_default();
        let edges = graph.entry(module.clone()).or_default();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (at, _) in line.match_indices("crate::") {
                let name: String = line
                    .get(at + "crate::".len()..)
                    .unwrap_or_default()
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module && name != "lock" {
                    edges.insert(name);
                }
            }
        }
    }
    Ok(graph)
}

/// A cycle through `graph`, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path.get(start..).unwrap_or_default().to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_module_graph_has_no_cycle() {
    let graph = module_graph().unwrap();
    assert!(graph.contains_key("plan") && graph.contains_key("worker"));
    assert!(graph["plan"].contains("routing"), "edges are read");
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "modules import each other in a circle: {}",
            cycle.join(" -> ")
        );
    }
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(find_cycle(&graph).unwrap(), ["a", "b", "c", "a"]);
}
