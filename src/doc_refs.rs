//! Every place in the workspace's sources that sends a reader to a document — `README, "Section"`,
//! `docs/file.md, "Section"` (in messages, findings and doc comments) — names a file that exists
//! and a heading that file has. Sections move; a message pointing at one that left is a dead end
//! for the user who reads it after an incident.

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's text with comment markers at line starts removed and lines joined, so that a
/// reference broken over two comment lines reads as one.
fn joined(text: &str) -> String {
    text.lines()
        .map(|line| {
            let t = line.trim_start();
            t.strip_prefix("//!")
                .or_else(|| t.strip_prefix("///"))
                .or_else(|| t.strip_prefix("//"))
                .unwrap_or(t)
                .trim()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `(document, section)` pairs: a document name followed by `, "Section"` or `("Section")`
/// (quotes possibly escaped, as inside a string literal).
fn references(text: &str) -> Vec<(String, Option<String>)> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(['R', 'd']) {
        rest = &rest[at..];
        let doc_len = if rest.starts_with("README") {
            "README".len()
        } else if let Some(tail) = rest.strip_prefix("docs/") {
            match tail.find(".md") {
                Some(end)
                    if tail[..end]
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c == '_' || c == '-')
                        && end > 0 =>
                {
                    "docs/".len() + end + ".md".len()
                }
                _ => {
                    rest = &rest[1..];
                    continue;
                }
            }
        } else {
            rest = &rest[1..];
            continue;
        };
        let doc = &rest[..doc_len];
        let after = rest[doc_len..]
            .strip_prefix(')')
            .unwrap_or(&rest[doc_len..]);
        // A section follows a separator (`, "S"`, `: "S"`, ` ("S")`), never the name itself
        // (`"../docs/sql.md")` is a string that ends there).
        let section = after
            .strip_prefix([',', ':'])
            .or_else(|| after.strip_prefix(" ("))
            .map(|s| s.trim_start_matches([' ', '(']))
            .map(|s| s.strip_prefix('\\').unwrap_or(s))
            .and_then(|s| s.strip_prefix('"'))
            .and_then(|s| Some(s[..s.find('"')?].trim_end_matches('\\').to_owned()))
            .filter(|s| !s.is_empty() && s.len() <= 80 && !s.contains(['{', '}', ';', '(']));
        // Plain mentions of the README (`include_str!("../README.md")`) are not references.
        if doc != "README" || section.is_some() {
            found.push((doc.to_owned(), section));
        }
        rest = &rest[doc_len..];
    }
    found
}

fn headings(file: &Path) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| l.trim_start_matches('#').trim().to_owned())
        .collect()
}

#[test]
fn every_document_and_section_a_source_names_exists() {
    let root = workspace();
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    for krate in std::fs::read_dir(root.join("crates"))
        .into_iter()
        .flatten()
        .flatten()
    {
        rust_files(&krate.path().join("src"), &mut files);
    }
    // This file's own examples are not references.
    files.retain(|f| !f.ends_with("src/doc_refs.rs"));
    assert!(files.len() > 40, "found the sources: {}", files.len());
    let mut checked = 0;
    let mut dead = Vec::new();
    for file in &files {
        let text = joined(&std::fs::read_to_string(file).unwrap_or_default());
        for (doc, section) in references(&text) {
            let path = if doc == "README" {
                root.join("README.md")
            } else {
                root.join(&doc)
            };
            let place = file.strip_prefix(&root).unwrap_or(file).display();
            if !path.exists() {
                dead.push(format!("{place}: {doc} does not exist"));
                continue;
            }
            if let Some(section) = section {
                let plain = |s: &str| s.replace('`', "");
                if !headings(&path).iter().any(|h| plain(h) == plain(&section)) {
                    dead.push(format!("{place}: {doc} has no section \"{section}\""));
                }
            }
            checked += 1;
        }
    }
    assert!(dead.is_empty(), "dead references:\n{}", dead.join("\n"));
    assert!(checked >= 10, "the scan found the references ({checked})");
}

#[test]
fn the_scan_finds_a_reference_and_its_section() {
    let text = joined("// see the README, \"After a Redis\n// failover\", and docs/sql.md.");
    assert_eq!(
        references(&text),
        vec![
            (
                "README".to_owned(),
                Some("After a Redis failover".to_owned())
            ),
            ("docs/sql.md".to_owned(), None),
        ]
    );
    let escaped = r#"msg (docs/operations.md, \"Redis ACL\")"#;
    assert_eq!(
        references(escaped),
        vec![(
            "docs/operations.md".to_owned(),
            Some("Redis ACL".to_owned())
        )]
    );
}
