//! Cargo refuses an import that points from one crate back up to another;
//! this test keeps the same rule inside each crate. For every crate of the
//! workspace it draws, from the code (comments and test modules aside), a
//! graph of each module's children — the crate's top-level modules, and
//! the children of each directory module — with an edge wherever one child
//! names another, by a `crate::` path or a `super::` chain (`super::x` of a
//! top-level module is the crate's `x`), and fails on any cycle, naming
//! it. The engine once imported its holder, which imported the engine; the
//! store's SQL module once imported its statements, which imported it.

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

/// The module path of `file` below `src` (`sql/records.rs` and
/// `sql/records/mod.rs` are `["sql", "records"]`; `lib.rs` is `[]`).
fn module_path(file: &Path, src: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut path: Vec<String> = rel
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned()
        })
        .collect();
    if path.last().is_some_and(|l| l == "mod") {
        path.pop();
    }
    if path.len() == 1 && ["lib", "main"].contains(&path[0].as_str()) {
        path.clear();
    }
    path
}

/// Every module path `code` (of the module at `at`) names: `crate::a::b`,
/// and `super::…` chains resolved from `at` (`super::super::x` of
/// `sql/records` is the crate's `x`).
fn references(code: &str, at: &[String]) -> Vec<Vec<String>> {
    let word = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
            .collect()
    };
    let path_after = |mut rest: &str| -> Vec<String> {
        let mut names = Vec::new();
        loop {
            let name = word(rest);
            if name.is_empty() {
                return names;
            }
            rest = &rest[name.len()..];
            names.push(name);
            match rest.strip_prefix("::") {
                Some(more) => rest = more,
                None => return names,
            }
        }
    };
    let mut found = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        // `idemgate_crate::…` and the like are other paths.
        if code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        found.push(path_after(&code[i + "crate::".len()..]));
    }
    let mut from = 0;
    while let Some(i) = code[from..].find("super::") {
        let start = from + i;
        if code[..start].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
            // The tail of a chain already read.
            from = start + "super::".len();
            continue;
        }
        let mut rest = &code[start..];
        let mut ups = 0;
        while let Some(more) = rest.strip_prefix("super::") {
            ups += 1;
            rest = more;
        }
        from = code.len() - rest.len();
        if ups <= at.len() {
            let mut target = at[..at.len() - ups].to_vec();
            target.extend(path_after(rest));
            found.push(target);
        }
    }
    found
}

/// The graphs of one crate: for every module, the graph of its children —
/// the crate's top-level modules, then each directory module's — with an
/// edge wherever code inside one child names another, by `crate::` or by
/// `super::` (parents may use their children: a child's parent is not its
/// sibling).
fn graphs(src: &Path) -> Vec<(String, Graph)> {
    let mut by_parent: BTreeMap<Vec<String>, Graph> = BTreeMap::new();
    for file in rust_files(src) {
        let at = module_path(&file, src);
        if at.is_empty() || at[0] == "bin" {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(&file).unwrap());
        // The module itself is a node of its parent's graph.
        for k in 0..at.len() {
            by_parent
                .entry(at[..k].to_vec())
                .or_default()
                .entry(at[k].clone())
                .or_default();
        }
        for target in references(&code, &at) {
            // Where the two paths part: an edge between siblings there.
            let shared = at.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if shared < at.len() && shared < target.len() {
                by_parent
                    .entry(at[..shared].to_vec())
                    .or_default()
                    .entry(at[shared].clone())
                    .or_default()
                    .insert(target[shared].clone());
            }
        }
    }
    by_parent
        .into_iter()
        .map(|(parent, mut graph)| {
            // Only modules of this parent are nodes (a name that is an item,
            // not a module, names nothing here).
            let names: BTreeSet<String> = graph.keys().cloned().collect();
            for to in graph.values_mut() {
                to.retain(|t| names.contains(t));
            }
            let name = src.join(parent.join("/")).display().to_string();
            (name, graph)
        })
        .collect()
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
