//! The layering rules of the source tree, read from the code's own `use` lines and `crate::`
//! paths, and the tests that keep them: in tracerd every import points to its own layer or one
//! below (the table `TRACERD_LAYERS`), and in every crate no two files import each other unless
//! they sit in one folder. `docs/internals/ARCHITECTURE.md` states the same rules in words.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// tracerd's top-level modules, bottom layer first. A module may import from its own layer and
/// the layers below; modules of one layer do not import each other both ways (rule two).
pub const TRACERD_LAYERS: &[&[&str]] = &[
    &["units", "build_info"],
    &["store"],
    &["model"],
    &["kernel"],
    &["serve"],
    &["view"],
    &["source"],
    &["cli", "config"],
    &["commands"],
    &["main", "lib", "reference"],
];

/// Imports that climb a layer on purpose, each with its reason: (from file, to module).
/// Paths are relative to the crate's `src/`.
pub const ALLOWED_CLIMBS: &[(&str, &str, &str)] = &[];

/// One source file: its path below `src/` and its module path (`view/report/text.rs` is
/// `["view", "report", "text"]`; `main.rs` and `lib.rs` are `["main"]` and `["lib"]`).
#[derive(Clone, Debug)]
pub struct SourceFile {
    pub path: String,
    pub module: Vec<String>,
    pub text: String,
}

/// Every `.rs` file below `src`, sorted by path.
pub fn read_tree(src: &Path) -> std::io::Result<Vec<SourceFile>> {
    let mut files = Vec::new();
    let mut todo = vec![src.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(src).expect("below src").to_string_lossy().into_owned();
                files.push(SourceFile {
                    module: module_of(&rel),
                    text: std::fs::read_to_string(&path)?,
                    path: rel,
                });
            }
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

/// The module path of a file below `src/`: `mod.rs` names its folder.
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel.trim_end_matches(".rs").split('/').map(str::to_owned).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The code of a file without comments, string and char literals (so a path in a doc comment
/// or a message is no import).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'r' if b.get(i + 1).is_some_and(|&c| c == b'"' || c == b'#') && !ident_before(b, i) => {
                // A raw string: r"..." or r#"..."#.
                let mut j = i + 1;
                let mut hashes = 0;
                while b.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                j += 1;
                let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
                while j < b.len() && !b[j..].starts_with(&close) {
                    j += 1;
                }
                i = j + close.len();
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            b'\'' => {
                // A char literal ('a', '\n', '\u{1F600}'), else a lifetime.
                let end = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 2..].iter().position(|&c| c == b'\'').map(|p| i + 2 + p)
                } else if b.get(i + 2) == Some(&b'\'') {
                    Some(i + 2)
                } else if b.get(i + 1).is_some_and(|c| !c.is_ascii()) {
                    // A multi-byte character: its quote closes within four bytes.
                    b[i + 2..b.len().min(i + 6)].iter().position(|&c| c == b'\'').map(|p| i + 2 + p)
                } else {
                    None
                };
                match end {
                    Some(e) => {
                        out.push_str("' '");
                        i = e + 1;
                    }
                    None => {
                        out.push('\'');
                        i += 1;
                    }
                }
            }
            c => {
                // Non-ASCII bytes (identifiers never need them here) become spaces, so the
                // result is ASCII and every byte index is a character boundary.
                out.push(if c.is_ascii() { c as char } else { ' ' });
                i += 1;
            }
        }
    }
    out
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// Every path a file names from its own crate, as module paths from the crate's root: the
/// leaves of its `use crate::{...}` trees, its `crate::a::b` paths in code, `super::` resolved
/// against the file's module, and (for a binary) the library's name as the crate.
pub fn imports(file: &SourceFile, lib_name: Option<&str>) -> BTreeSet<Vec<String>> {
    let code = code_only(&file.text);
    let mut found = BTreeSet::new();
    let roots: Vec<&str> = ["crate", "super"].into_iter().chain(lib_name).collect();
    let b = code.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let Some(root) = roots.iter().find(|r| code[i..].starts_with(&format!("{r}::"))) else {
            i += 1;
            continue;
        };
        if ident_before(b, i) || (i > 0 && b[i - 1] == b':') {
            i += root.len();
            continue;
        }
        // `super` inside an inline module (`mod tests { use super::*; }`) is the file itself.
        let inline = *root == "super" && indented(&code, i);
        let base: Vec<String> = match *root {
            "super" if inline => file.module.clone(),
            "super" => file.module[..file.module.len().saturating_sub(1)].to_vec(),
            _ => Vec::new(),
        };
        let (tree, end) = use_tree(&code, i + root.len() + 2);
        for leaf in tree {
            let mut path = base.clone();
            path.extend(leaf);
            if !path.is_empty() {
                found.insert(path);
            }
        }
        i = end;
    }
    found
}

/// Whether the line holding byte `i` starts with whitespace.
fn indented(code: &str, i: usize) -> bool {
    let start = code[..i].rfind('\n').map_or(0, |p| p + 1);
    code[start..].starts_with([' ', '\t'])
}

/// The module paths of a use tree (or a plain path) starting at byte `i`: `a::{b, c::{d}}`
/// gives `a::b` and `a::c::d`; `self` names its parent; `*` and `as` are dropped.
fn use_tree(code: &str, mut i: usize) -> (Vec<Vec<String>>, usize) {
    let b = code.as_bytes();
    let mut prefix: Vec<String> = Vec::new();
    loop {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if b.get(i) == Some(&b'{') {
            let mut leaves = Vec::new();
            i += 1;
            loop {
                while i < b.len() && (b[i].is_ascii_whitespace() || b[i] == b',') {
                    i += 1;
                }
                if i >= b.len() || b[i] == b'}' {
                    i += 1;
                    break;
                }
                let (sub, end) = use_tree(code, i);
                for s in sub {
                    let mut p = prefix.clone();
                    p.extend(s);
                    leaves.push(p);
                }
                i = end;
            }
            return (leaves, i);
        }
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'*') {
            i += 1;
        }
        let segment = &code[start..i];
        match segment {
            "" | "*" => {}
            "self" => {}
            s => prefix.push(s.to_owned()),
        }
        if code[i..].starts_with("::") {
            i += 2;
            continue;
        }
        // `as name`, `;`, `,`, `}` or the rest of an expression end the path.
        let rest = code[i..].trim_start();
        if let Some(after) = rest.strip_prefix("as ") {
            let skip = code.len() - after.len();
            let name_end =
                after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
            i = skip + name_end;
        }
        return (vec![prefix], i);
    }
}

/// The file a module path lands in: the longest prefix that is a file of the tree.
fn file_of<'a>(files: &'a BTreeMap<Vec<String>, String>, path: &[String]) -> Option<&'a String> {
    (1..=path.len()).rev().find_map(|n| files.get(&path[..n]))
}

/// Whether two files may import each other: one is the root of the folder the other is in
/// (`a/b.rs` and `a/b/c.rs`: a root declares its files and they use what it declares), or both
/// sit in one concept folder (`model/recorder/frame.rs` and `model/recorder/codec.rs`). A
/// concept folder is at least `concept_depth` deep: in tracerd the top folders are layers
/// (`model/`, `serve/`), whose files must not import each other both ways; in the other crates
/// `src/` itself is that layer.
fn in_one_folder(a: &[String], b: &[String], concept_depth: usize) -> bool {
    let parent = |m: &[String]| m[..m.len().saturating_sub(1)].to_vec();
    b.starts_with(a) || a.starts_with(b) || (parent(a) == parent(b) && parent(a).len() >= concept_depth)
}

/// A breach of the rules, as a line for the test's failure message.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Breach {
    /// `file` (layer `from`) imports `module` of a layer above (`to`).
    Climb { file: String, module: String, from: usize, to: usize },
    /// Two files in different folders import each other.
    Circle { a: String, b: String },
}

impl std::fmt::Display for Breach {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Breach::Climb { file, module, from, to } => write!(
                f,
                "{file} (layer {from}) imports {module} (layer {to}): move the piece it needs down, \
                 or the importer up"
            ),
            Breach::Circle { a, b } => write!(
                f,
                "{a} and {b} import each other: move what both need below both, or make one the root of the other's folder"
            ),
        }
    }
}

/// The file-to-file imports of a crate: (importer, imported), both paths below `src/`.
pub fn edges(files: &[SourceFile], lib_name: Option<&str>) -> BTreeSet<(String, String)> {
    let by_module: BTreeMap<Vec<String>, String> =
        files.iter().map(|f| (f.module.clone(), f.path.clone())).collect();
    let mut out = BTreeSet::new();
    for f in files {
        let lib = (f.module == ["main"]).then_some(lib_name).flatten();
        for path in imports(f, lib) {
            if let Some(to) = file_of(&by_module, &path)
                && to != &f.path
            {
                out.insert((f.path.clone(), to.clone()));
            }
        }
    }
    out
}

/// Rule two for any crate: no two files import each other unless they share a folder (see
/// `in_one_folder`).
pub fn circles(files: &[SourceFile], lib_name: Option<&str>, concept_depth: usize) -> Vec<Breach> {
    let module: BTreeMap<&str, &[String]> = files.iter().map(|f| (f.path.as_str(), &f.module[..])).collect();
    let edges = edges(files, lib_name);
    edges
        .iter()
        .filter(|(a, b)| a < b && edges.contains(&(b.clone(), a.clone())))
        .filter(|(a, b)| !in_one_folder(module[a.as_str()], module[b.as_str()], concept_depth))
        .map(|(a, b)| Breach::Circle { a: a.clone(), b: b.clone() })
        .collect()
}

/// Rule one for tracerd: every import points to the importer's layer or below.
pub fn climbs(files: &[SourceFile], layers: &[&[&str]], lib_name: Option<&str>) -> Vec<Breach> {
    let layer_of = |top: &str| layers.iter().position(|l| l.contains(&top));
    let mut out = Vec::new();
    for f in files {
        let lib = (f.module == ["main"]).then_some(lib_name).flatten();
        let Some(from) = layer_of(&f.module[0]) else {
            out.push(Breach::Climb {
                file: f.path.clone(),
                module: f.module[0].clone(),
                from: usize::MAX,
                to: 0,
            });
            continue;
        };
        for path in imports(f, lib) {
            let Some(to) = layer_of(&path[0]) else { continue };
            let allowed =
                ALLOWED_CLIMBS.iter().any(|(file, module, _)| *file == f.path && path[0] == *module);
            if to > from && !allowed {
                out.push(Breach::Climb { file: f.path.clone(), module: path.join("::"), from, to });
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The repository's root (xtask's parent).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask has a parent").to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(crate_dir: &str) -> Vec<SourceFile> {
        read_tree(&root().join(crate_dir).join("src")).expect("read the source tree")
    }

    fn file(path: &str, text: &str) -> SourceFile {
        SourceFile { path: path.into(), module: module_of(path), text: text.into() }
    }

    fn shown(breaches: &[Breach]) -> String {
        breaches.iter().map(|b| format!("  {b}\n")).collect()
    }

    #[test]
    fn every_tracerd_import_points_to_its_layer_or_below() {
        let files = tree("tracerd");
        assert!(files.len() > 40, "read {} files", files.len());
        let breaches = climbs(&files, TRACERD_LAYERS, Some("tracerd"));
        assert!(breaches.is_empty(), "imports that climb a layer:\n{}", shown(&breaches));
    }

    #[test]
    fn no_two_files_import_each_other_across_folders() {
        let mut found = String::new();
        for (dir, lib, depth) in
            [("tracerd", Some("tracerd"), 2), ("xtask", None, 1), ("tracer-ebpf", None, 1)]
        {
            let breaches = circles(&tree(dir), lib, depth);
            if !breaches.is_empty() {
                found += &format!("{dir}:\n{}", shown(&breaches));
            }
        }
        assert!(found.is_empty(), "files that import each other:\n{found}");
    }

    #[test]
    fn use_trees_comments_strings_and_super_are_read_as_rust_reads_them() {
        let f = file(
            "view/report/text.rs",
            "//! crate::serve::api in a comment\n\
             use crate::{\n    model::{capture, op::Op as O},\n    view::style::Style,\n};\n\
             use super::*;\n\
             fn f() { let s = \"crate::kernel::x\"; let c = '\"'; crate::units::rfc(1.0); }\n\
             #[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::source::rolling;\n}\n",
        );
        let got: Vec<String> = imports(&f, None).into_iter().map(|p| p.join("::")).collect();
        assert_eq!(
            got,
            [
                "model::capture",
                "model::op::Op",
                "source::rolling",
                "units::rfc",
                "view::report",
                "view::report::text",
                "view::style::Style"
            ]
        );
    }

    #[test]
    fn a_climbing_import_and_a_circle_are_caught() {
        let files = [
            file("model/op.rs", "use crate::kernel::btf::Btf;\n"),
            file("kernel/btf.rs", "use crate::model::op::Op;\n"),
            file("kernel/ops.rs", "use crate::{kernel::btf::Btf, model::op::Op};\n"),
            file("view/report.rs", "mod text;\nuse crate::view::report::text::t;\n"),
            file("view/report/text.rs", "use super::*;\nuse crate::view::report::Report;\n"),
            file("model/recorder/frame.rs", "use crate::model::recorder::codec::encode;\n"),
            file("model/recorder/codec.rs", "use crate::model::recorder::frame::Frame;\n"),
            file("serve/metrics.rs", "use crate::serve::exemplars::Exemplars;\n"),
            file("serve/exemplars.rs", "use crate::serve::metrics::BUCKETS_S;\n"),
        ];
        let climbs = climbs(&files, TRACERD_LAYERS, None);
        assert_eq!(
            climbs,
            [Breach::Climb { file: "model/op.rs".into(), module: "kernel::btf::Btf".into(), from: 2, to: 3 }]
        );
        assert_eq!(
            circles(&files, None, 2),
            [
                Breach::Circle { a: "kernel/btf.rs".into(), b: "model/op.rs".into() },
                Breach::Circle { a: "serve/exemplars.rs".into(), b: "serve/metrics.rs".into() },
            ],
            "siblings in a layer folder may not import each other; in a concept folder they may"
        );
    }

    #[test]
    fn every_tracerd_module_has_a_layer() {
        for f in tree("tracerd").iter().filter(|f| f.module.len() == 1 || f.path.ends_with("/mod.rs")) {
            assert!(
                TRACERD_LAYERS.iter().any(|l| l.contains(&f.module[0].as_str())),
                "{} has no layer in TRACERD_LAYERS: add it where its imports put it",
                f.path
            );
        }
    }
}
