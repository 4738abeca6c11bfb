//! Cargo refuses an import that points from one crate back up to another;
//! this test keeps the same rule inside each crate. For every crate of the
//! workspace it draws two graphs from the code (comments and test modules
//! aside): the crate's top-level modules (`crate::x`), and the children of
//! each directory module (`super::x` between siblings), and fails on any
//! cycle, naming it. The engine once imported its holder, which imported
//! the engine.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn code_of(text: &str) -> String {
    // Unit tests may reach anywhere; only the code counts.
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module names that follow `prefix` in `code`.
fn targets(code: &str, prefix: &str) -> BTreeSet<String> {
    code.match_indices(prefix)
        .map(|(i, _)| {
            code[i + prefix.len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
                .collect::<String>()
        })
        .filter(|to| !to.is_empty())
        .collect()
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files
}

/// The name of the module `file` belongs to, at `depth` below `root`
/// (`a/b.rs` and `a/b/mod.rs` at depth 1 are `b`; at depth 0, `a`).
fn module_at(file: &Path, root: &Path) -> Option<String> {
    let rel = file.strip_prefix(root).ok()?;
    let first = rel.components().next()?.as_os_str().to_string_lossy();
    Some(first.trim_end_matches(".rs").to_owned())
}

/// The graphs of one crate: its top-level modules, then each directory
/// module's children.
fn graphs(src: &Path) -> Vec<(String, Graph)> {
    let mut all = Vec::new();
    let mut top = Graph::new();
    for file in rust_files(src) {
        let Some(from) = module_at(&file, src) else {
            continue;
        };
        if ["lib", "main", "bin"].contains(&from.as_str()) {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(&file).unwrap());
        let to = top.entry(from.clone()).or_default();
        to.extend(targets(&code, "crate::").into_iter().filter(|t| *t != from));
    }
    all.push((src.display().to_string(), top));
    for dir in rust_files(src)
        .iter()
        .filter_map(|f| f.parent().map(Path::to_path_buf))
        .collect::<BTreeSet<_>>()
    {
        if dir == src {
            continue;
        }
        let mut siblings = Graph::new();
        for file in std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()) {
            if file.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let from = file.file_stem().unwrap().to_string_lossy().into_owned();
            if from == "mod" {
                continue;
            }
            let code = code_of(&std::fs::read_to_string(&file).unwrap());
            let to = siblings.entry(from.clone()).or_default();
            to.extend(targets(&code, "super::").into_iter().filter(|t| *t != from));
        }
        let names: BTreeSet<String> = siblings.keys().cloned().collect();
        for to in siblings.values_mut() {
            to.retain(|t| names.contains(t));
        }
        all.push((dir.display().to_string(), siblings));
    }
    all
}

/// A cycle through `start`, if there is one.
fn cycle_from(
    edges: &Graph,
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

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn no_crate_has_an_import_cycle_between_its_modules() {
    let mut crates: Vec<PathBuf> = std::fs::read_dir(workspace().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path().join("src"))
        .collect();
    crates.push(workspace().join("src"));
    assert!(crates.len() >= 8, "the crates were not found: {crates:?}");
    let mut checked = 0;
    for src in crates {
        for (place, edges) in graphs(&src) {
            checked += edges.len();
            for module in edges.keys() {
                let mut path = vec![module.clone()];
                if let Some(cycle) =
                    cycle_from(&edges, module, module, &mut path, &mut BTreeSet::new())
                {
                    panic!(
                        "import cycle in {place}: {}\n{edges:#?}",
                        cycle.join(" -> ")
                    );
                }
            }
        }
    }
    assert!(checked > 50, "too few modules read: {checked}");
}

#[test]
fn the_engine_and_its_siblings_point_one_way() {
    let engine = workspace().join("crates/idemgate/src");
    let graphs = graphs(&engine);
    let (_, idempotency) = graphs
        .iter()
        .find(|(place, _)| place.ends_with("idempotency"))
        .expect("idempotency/ was read");
    // The engine uses the holder, the layer uses the engine; never back.
    for (from, not_to) in [
        ("holder", "engine"),
        ("engine", "layer"),
        ("reconcile", "engine"),
    ] {
        assert!(
            !idempotency[from].contains(not_to),
            "{from} imports {not_to}: {idempotency:#?}"
        );
    }
}
