//! The crate's layers, bottom up, as README's layer table gives them: each module may name only
//! modules of its own layer or below, and the two architectures never name each other. The
//! x86 floor (`x86::mmu`, `x86::spte`, `x86::arch`, ...) sits below its two MMU flavours
//! (`x86::tdp_mmu`, `x86::shadow`), which it drives through traits.
//!
//! Read from the source: every `crate::` path outside comments and `#[cfg(test)]` code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layer of a module path (`x86::shadow::rmap`), and its architecture if it has one.
fn layer(module: &str) -> Option<(u32, Option<&'static str>)> {
    let top = module.split("::").next()?;
    Some(match top {
        "units" => (0, None),
        "hw" => (1, None),
        "host" => (2, None),
        "kvm" => (3, None),
        "x86" if module.starts_with("x86::shadow") || module.starts_with("x86::tdp_mmu") => {
            (5, Some("x86"))
        }
        "x86" => (4, Some("x86")),
        "arm64" => (4, Some("arm64")),
        "vm" => (6, None),
        "cost" => (7, None),
        "engine" => (8, None),
        "lab" => (9, None),
        _ => return None,
    })
}

/// Every `crate::` path named in `src` outside comments and `#[cfg(test)]` code.
fn crate_paths(src: &str) -> Vec<String> {
    let code = src.split("#[cfg(test)]").next().unwrap_or("");
    let mut out = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let path: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            out.push(path.trim_end_matches(':').to_string());
        }
    }
    out
}

/// The imports of `module` (its source `src`) that break the layering, as `from -> to` lines.
fn violations(module: &str, src: &str) -> Vec<String> {
    let Some((from_layer, from_arch)) = layer(module) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for target in crate_paths(src) {
        let Some((to_layer, to_arch)) = layer(&target) else {
            continue;
        };
        let other_arch = matches!((from_arch, to_arch), (Some(a), Some(b)) if a != b);
        if to_layer > from_layer || other_arch {
            out.push(format!("{module} -> {target}"));
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/x86/shadow/mod.rs` -> `x86::shadow`.
fn module_of(root: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(root).expect("file under src");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts.join("::")
}

/// The modules of `modules` that `from` names (a path resolves to its longest module prefix),
/// itself left out.
fn module_edges(from: &str, src: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    crate_paths(src)
        .iter()
        .filter_map(|p| {
            let parts: Vec<&str> = p.split("::").collect();
            (1..=parts.len())
                .rev()
                .map(|n| parts[..n].join("::"))
                .find(|m| modules.contains(m))
        })
        .filter(|m| m != from)
        .collect()
}

/// A cycle of the graph `edges` among the modules under `prefix`, if there is one.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>, prefix: &str) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        prefix: &str,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(m.to_string(), 1);
        stack.push(m.to_string());
        for t in edges.get(m).into_iter().flatten() {
            if !t.starts_with(prefix) {
                continue;
            }
            match state.get(t.as_str()) {
                Some(1) => {
                    let i = stack.iter().position(|s| s == t).expect("on the stack");
                    return Some(stack[i..].to_vec());
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(t, edges, prefix, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(m.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in edges.keys().filter(|m| m.starts_with(prefix)) {
        if !state.contains_key(m.as_str()) {
            if let Some(c) = visit(m, edges, prefix, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The x86 layer (its floor and both MMU flavours) has no import cycle: each module can be
/// read knowing only the ones below it.
#[test]
fn x86_has_no_import_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(&root, f)).collect();
    let mut edges = BTreeMap::new();
    for f in &files {
        let m = module_of(&root, f);
        let src = std::fs::read_to_string(f).expect("readable source file");
        edges.insert(m.clone(), module_edges(&m, &src, &modules));
    }
    assert_eq!(find_cycle(&edges, "x86"), None);
    // Negative control: a back edge closes a cycle the check finds.
    edges
        .entry("x86::spte".to_string())
        .or_default()
        .insert("x86::shadow::fault".to_string());
    assert!(find_cycle(&edges, "x86").is_some());
}

#[test]
fn every_module_names_only_its_own_layer_or_below() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    assert!(files.len() > 50, "found only {} source files", files.len());
    let mut bad = Vec::new();
    for f in &files {
        let src = std::fs::read_to_string(f).expect("readable source file");
        bad.extend(violations(&module_of(&root, f), &src));
    }
    assert!(bad.is_empty(), "imports up the layers:\n{}", bad.join("\n"));
}

/// Negative control: the checker sees an import up, across architectures, from the x86 floor
/// into a flavour, and ignores comments and test code.
#[test]
fn the_layer_check_finds_imports_up() {
    assert_eq!(
        violations("vm::kswapd", "use crate::engine::HostThread;\n"),
        ["vm::kswapd -> engine::HostThread"]
    );
    assert_eq!(
        violations("x86::mmu", "use crate::x86::shadow::nested::GuestMmu;"),
        ["x86::mmu -> x86::shadow::nested::GuestMmu"]
    );
    assert_eq!(
        violations("arm64::mmu", "let x = crate::x86::spte::Level::default();"),
        ["arm64::mmu -> x86::spte::Level::default"]
    );
    assert!(violations("kvm::mmu", "// see crate::vm::Vm\nuse crate::units::Gfn;").is_empty());
    assert!(violations("kvm::mmu", "#[cfg(test)]\nmod t { use crate::vm::Vm; }").is_empty());
    assert!(violations("x86::shadow::fault", "use crate::x86::mmu::KvmPageFault;").is_empty());
}
