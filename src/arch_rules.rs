//! The invariants of `docs/architecture.md` that a reading of the sources can check: what may
//! import what, where SQL text is made from strings, what the library links. Each test names
//! the rule it checks; a failure says which file broke it.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, as (path relative to the crate root, text).
fn sources(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(root())
                    .unwrap()
                    .to_string_lossy()
                    .replace('\\', "/");
                out.push((rel, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// The lines of `text` that are code: comments (`//`, `///`, `//!`) left out.
fn code_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter(|l| !l.trim_start().starts_with("//"))
}

/// The issuers hand out tokens; they never write rows, audit, guard or record effects. Their
/// one read of PostgreSQL is the floor a lost counter restarts above
/// (`crate::admin::counter_floor`, in `token_issuer.rs`).
#[test]
fn the_issuers_do_not_reach_into_the_write_path() {
    let forbidden = [
        "crate::repository",
        "crate::audit",
        "crate::guard",
        "crate::effect",
        "crate::fence",
        "crate::recovery",
    ];
    let mut broken = Vec::new();
    for (file, text) in sources(&root().join("src/issuer")) {
        for line in code_lines(&text) {
            if forbidden.iter().any(|f| line.contains(f))
                || (line.contains("crate::admin") && !file.ends_with("token_issuer.rs"))
            {
                broken.push(format!("{file}: {}", line.trim()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "the issuers import the write path: {broken:#?}"
    );
}

/// SQL text is made from strings (`sqlx::AssertSqlSafe`) in these files only; each builds it
/// from quoted identifiers (`crate::ident`) or from constants. A new file doing it must be
/// reviewed for quoting and added here.
#[test]
fn sql_text_is_made_from_strings_in_the_listed_files_only() {
    let listed = [
        "src/admin/doctor/tables.rs",
        "src/admin/grant.rs",
        "src/admin/migrate.rs",
        "src/issuer/pg.rs",
        "src/repository/executor.rs",
        "src/repository/sql/mod.rs",
    ];
    let found: Vec<String> = sources(&root().join("src"))
        .into_iter()
        .filter(|(file, text)| {
            file != "src/arch_rules.rs" && code_lines(text).any(|l| l.contains("AssertSqlSafe"))
        })
        .map(|(file, _)| file)
        .collect();
    assert_eq!(found, listed, "files that make SQL text from strings");
}

/// The library is what a job links: no CLI, test-kit or bench crate among its dependencies.
#[test]
fn the_library_links_no_cli_testkit_or_bench_crate() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let deps = manifest
        .split("\n[dependencies]\n")
        .nth(1)
        .expect("a [dependencies] table")
        .split("\n[")
        .next()
        .unwrap();
    for name in [
        "anyhow",
        "clap",
        "pgfence-testkit",
        "pgfence-cli",
        "pgfence-bench",
        "pgfence-chaos",
    ] {
        assert!(
            !deps
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{name} "))
                    || l.trim_start().starts_with(&format!("{name}."))
                    || l.trim_start().starts_with(&format!("{name}="))),
            "the library depends on {name}"
        );
    }
}
