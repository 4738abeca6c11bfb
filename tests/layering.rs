//! The crate's modules point one way (#15, STYLE): the store at the bottom,
//! the engine and policies over it, the proxy beside them, the gateway
//! (config, router, server, admin) on top. This test reads `src/`, draws
//! the top-level module graph from `crate::…` paths (comments and test
//! modules aside) and fails on any cycle, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Modules whose imports do not count: the binaries' entry points.
const ROOTS: [&str; 3] = ["main", "lib", "bin"];

fn module_of(path: &Path, src: &Path) -> String {
    let rel = path.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_owned()
}

fn code_of(text: &str) -> String {
    // Unit tests may reach anywhere; only the code counts.
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let from = module_of(&path, &src);
            if ROOTS.contains(&from.as_str()) {
                continue;
            }
            let code = code_of(&std::fs::read_to_string(&path).unwrap());
            let targets = edges.entry(from.clone()).or_default();
            for (i, _) in code.match_indices("crate::") {
                let to: String = code[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
                    .collect();
                if !to.is_empty() && to != from {
                    targets.insert(to);
                }
            }
        }
    }
    edges
}

/// A cycle through `start`, if there is one.
fn cycle_from(
    edges: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    at: &str,
    path: &mut Vec<String>,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    for next in edges.get(at).into_iter().flatten() {
        if next == start {
            let mut cycle = path.clone();
            cycle.push(start.to_owned());
            return Some(cycle);
        }
        if seen.insert(next.clone()) {
            path.push(next.clone());
            if let Some(cycle) = cycle_from(edges, start, next, path, seen) {
                return Some(cycle);
            }
            path.pop();
        }
    }
    None
}

#[test]
fn the_module_imports_have_no_cycle() {
    let edges = graph();
    assert!(edges.len() > 10, "src/ was not read: {edges:?}");
    for module in edges.keys() {
        let mut path = vec![module.clone()];
        if let Some(cycle) = cycle_from(&edges, module, module, &mut path, &mut BTreeSet::new()) {
            panic!(
                "import cycle: {}\nthe graph: {edges:#?}",
                cycle.join(" -> ")
            );
        }
    }
}

#[test]
fn the_bottom_layers_import_nothing_above_them() {
    let edges = graph();
    let bottom = [
        "error",
        "identity",
        "request_id",
        "hop_by_hop",
        "tls",
        "metrics",
        "limits",
    ];
    for module in bottom {
        let reaches: Vec<_> = edges
            .get(module)
            .into_iter()
            .flatten()
            .filter(|to| !bottom.contains(&to.as_str()))
            .collect();
        assert!(reaches.is_empty(), "{module} imports {reaches:?}");
    }
    for (module, above) in [
        (
            "store",
            [
                "config",
                "gateway",
                "idempotency",
                "proxy",
                "router",
                "server",
            ],
        ),
        (
            "idempotency",
            ["config", "gateway", "proxy", "router", "server", "token"],
        ),
        (
            "proxy",
            [
                "config", "gateway", "server", "admin", "consumer", "callback",
            ],
        ),
    ] {
        let reaches: Vec<_> = edges
            .get(module)
            .into_iter()
            .flatten()
            .filter(|to| above.contains(&to.as_str()))
            .collect();
        assert!(reaches.is_empty(), "{module} imports {reaches:?} above it");
    }
}
