//! The workspace's rules for tests that need an optional server (Redis Sentinel, etcd,
//! ZooKeeper, PgBouncer, Patroni), read from the test sources:
//!
//! * they go through the one skip mechanism, `pgfence_testkit::needs` (or a module's
//!   `needs_*` wrapper of it), never the programs' `optional::installed` — the start
//!   functions take the proof `needs` hands out, so a test that forgets cannot start one;
//! * they never unwrap `needs` (a panic where they must skip), and a test that starts the race
//!   harness's Sentinel, etcd or ZooKeeper deployment (a program's API) asks `needs` first;
//! * every such test is named in `.ci/optional-tests`, the list `.ci/run` runs again with the
//!   servers hidden (`PGFENCE_TESTKIT_HIDE`), which proves that each one skips instead of
//!   failing on a machine without them.
//!
//! A failure names the file and the test, and what to change.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// One test source file: its package, its test binary, and the module path of the file in
/// that binary (empty for the binary's root file).
#[derive(Debug)]
struct TestFile {
    path: PathBuf,
    package: String,
    binary: String,
    module: Vec<String>,
}

fn package_name(crate_dir: &Path) -> String {
    let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml")).unwrap();
    manifest
        .lines()
        .find_map(|l| {
            let v = l.trim().strip_prefix("name")?.trim().strip_prefix('=')?;
            Some(v.trim().trim_matches('"').to_owned())
        })
        .unwrap()
}

/// The integration test files of every workspace crate (`tests/` of the root crate and of
/// each member under `crates/`).
fn test_files() -> Vec<TestFile> {
    let root = workspace();
    let mut crates = vec![root.clone()];
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let dir = entry.unwrap().path();
        if dir.join("Cargo.toml").is_file() {
            crates.push(dir);
        }
    }
    let mut out = Vec::new();
    for dir in crates {
        let tests = dir.join("tests");
        if !tests.is_dir() {
            continue;
        }
        let package = package_name(&dir);
        for path in rust_files(&tests) {
            // This file's own text names the mechanism.
            if path.ends_with("testkit/tests/skip_rule.rs") {
                continue;
            }
            let rel: Vec<String> = path
                .strip_prefix(&tests)
                .unwrap()
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            let strip = |s: &str| s.trim_end_matches(".rs").to_owned();
            let (binary, module) = if rel.len() == 1 {
                (strip(&rel[0]), Vec::new())
            } else {
                let mut module: Vec<String> = rel[1..].iter().map(|c| strip(c)).collect();
                if matches!(module.last().map(String::as_str), Some("main" | "mod")) {
                    module.pop();
                }
                (rel[0].clone(), module)
            };
            out.push(TestFile {
                path,
                package: package.clone(),
                binary,
                module,
            });
        }
    }
    out
}

/// Whether `line` asks the skip mechanism: `needs::<...>(` or a module's `needs_*(` wrapper
/// (also as a `lease_tests!` argument).
fn asks(line: &str) -> bool {
    line.contains("needs::<")
        || line.match_indices("needs_").any(|(i, _)| {
            i == 0
                || !matches!(line.as_bytes()[i - 1], b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_')
        })
}

/// The tests of `file` that ask the skip mechanism, as `module::path::test` (or
/// `module::path::` for a `lease_tests!` invocation, which defines several), with the line.
fn asking_tests(file: &TestFile) -> Vec<(String, usize)> {
    let text = std::fs::read_to_string(&file.path).unwrap();
    let mut mods: Vec<(String, i64)> = Vec::new();
    let mut depth: i64 = 0;
    // The fn the line is in, and the depth its body closes at.
    let mut current_fn: Option<(String, i64)> = None;
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split("//").next().unwrap_or("");
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed
            .strip_prefix("mod ")
            .or_else(|| trimmed.strip_prefix("pub mod "))
            .or_else(|| trimmed.strip_prefix("pub(crate) mod "))
            && let Some(name) = rest.strip_suffix('{').map(str::trim)
        {
            mods.push((name.to_owned(), depth + 1));
        }
        if let Some(i) = line.find("fn ") {
            let name: String = line[i + 3..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                current_fn = Some((name, depth));
            }
        }
        // The wrappers' own definitions (and the suite's) are not tests.
        let fn_name = current_fn.as_ref().map_or("", |(name, _)| name.as_str());
        let defines = fn_name.starts_with("needs") || fn_name == "external_or_needs";
        if asks(line) && !defines && !trimmed.starts_with("use ") {
            let mut path: Vec<String> = file.module.clone();
            path.extend(mods.iter().map(|(m, _)| m.clone()));
            let name = if line.contains("lease_tests!") {
                format!("{}::", path.join("::"))
            } else {
                path.push(fn_name.to_owned());
                path.join("::")
            };
            out.push((name, n + 1));
        }
        depth += i64::try_from(line.matches('{').count()).unwrap();
        depth -= i64::try_from(line.matches('}').count()).unwrap();
        while mods.last().is_some_and(|(_, d)| depth < *d) {
            mods.pop();
        }
        if line.contains('}') && current_fn.as_ref().is_some_and(|(_, d)| depth <= *d) {
            current_fn = None;
        }
    }
    out
}

/// `.ci/optional-tests`: `(package, binary, filter)` per line (comments and blank lines out).
fn listed() -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(workspace().join(".ci/optional-tests")).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(
                parts.len(),
                3,
                ".ci/optional-tests: `package binary filter` per line, got {l:?}"
            );
            (parts[0].into(), parts[1].into(), parts[2].into())
        })
        .collect()
}

/// Every test that asks for an optional server is named in `.ci/optional-tests`, so
/// `.ci/run`'s run with the servers hidden covers it.
#[test]
fn every_test_that_needs_an_optional_server_is_run_with_the_servers_hidden() {
    let listed = listed();
    let mut missing = Vec::new();
    let mut found = 0;
    for file in test_files() {
        for (test, line) in asking_tests(&file) {
            found += 1;
            let covered = listed.iter().any(|(package, binary, filter)| {
                *package == file.package && *binary == file.binary && test.contains(filter.as_str())
            });
            if !covered {
                missing.push(format!(
                    "{}:{line}: add `{} {} {test}` to .ci/optional-tests",
                    file.path.strip_prefix(workspace()).unwrap().display(),
                    file.package,
                    file.binary
                ));
            }
        }
    }
    // The workspace has tests on every optional server: a scan that finds none is broken.
    assert!(
        found >= 20,
        "found only {found} tests asking for an optional server"
    );
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// Every line of `.ci/optional-tests` still names a test (a renamed test leaves no dead line
/// that matches nothing, or something else).
#[test]
fn every_listed_filter_matches_a_test_that_needs_an_optional_server() {
    let mut asking = BTreeSet::new();
    for file in test_files() {
        for (test, _) in asking_tests(&file) {
            asking.insert((file.package.clone(), file.binary.clone(), test));
        }
    }
    let dead: Vec<String> = listed()
        .into_iter()
        .filter(|(package, binary, filter)| {
            !asking
                .iter()
                .any(|(p, b, t)| p == package && b == binary && t.contains(filter.as_str()))
        })
        .map(|(p, b, f)| format!("{p} {b} {f}"))
        .collect();
    assert!(
        dead.is_empty(),
        ".ci/optional-tests lines that match no test asking for an optional server:\n{}",
        dead.join("\n")
    );
}

/// Tests never take the programs' way to the proof (`optional::installed`), which fails
/// instead of skipping.
#[test]
fn tests_ask_through_needs_not_installed() {
    let mut broken = Vec::new();
    for file in test_files() {
        let text = std::fs::read_to_string(&file.path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("installed::<") || code.contains("optional::installed") {
                broken.push(format!(
                    "{}:{}: {}",
                    file.path.strip_prefix(workspace()).unwrap().display(),
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "tests skip through pgfence_testkit::needs, not optional::installed:\n{}",
        broken.join("\n")
    );
}

/// Each `fn` of `text`, as (name, body from its `{` to the matching `}`).
fn fn_bodies(text: &str) -> Vec<(String, String)> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    for (at, _) in code.match_indices("fn ") {
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let Some(open) = code[at..].find(['{', ';']).map(|i| at + i) else {
            continue;
        };
        if name.is_empty() || code.as_bytes()[open] == b';' {
            continue;
        }
        let mut depth = 0;
        for (i, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push((name.clone(), code[open..=open + i].to_owned()));
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// The ways around the mechanism a reading can see: a test that unwraps `needs` (a panic
/// where it should skip), and a test that starts the race harness's replicated or
/// consensus-store deployment (`Deployment::start`, a program's API, which asks
/// `optional::installed`) without asking `needs` first.
#[test]
fn no_test_unwraps_needs_or_starts_a_deployment_without_it() {
    let mut broken = Vec::new();
    for file in test_files() {
        let text = std::fs::read_to_string(&file.path).unwrap();
        let rel = file
            .path
            .strip_prefix(workspace())
            .unwrap()
            .display()
            .to_string();
        for (name, body) in fn_bodies(&text) {
            let flat: String = body.split_whitespace().collect();
            for call in ["needs::<", "needs_"] {
                for (i, _) in flat.match_indices(call) {
                    let rest = &flat[i..];
                    let statement = rest.split(';').next().unwrap_or(rest);
                    if statement.contains(").unwrap()") || statement.contains(").expect(") {
                        broken.push(format!("{rel}: {name} unwraps {call}...: it must skip"));
                    }
                }
            }
            let optional_deployment = [
                "Deployment::start(IssuerKind::Etcd",
                "Deployment::start(IssuerKind::ZooKeeper",
                "Deployment::start(IssuerKind::Redis,true",
            ];
            if optional_deployment.iter().any(|d| flat.contains(d)) && !flat.contains("needs::<") {
                broken.push(format!(
                    "{rel}: {name} starts an optional server's Deployment without asking \
                     pgfence_testkit::needs first"
                ));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The scanner itself: a test asking in a nested module, a wrapper definition, and a
/// `lease_tests!` invocation.
#[test]
fn the_scanner_finds_tests_by_module_and_name() {
    let dir = std::env::temp_dir().join(format!("pgfence-skip-rule-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sample.rs");
    std::fs::write(
        &path,
        "fn needs_etcd(test: &str) -> Option<()> {\n    needs::<Etcd>(test).map(|_| ())\n}\n\
         lease_tests!(ETCD, needs_etcd, issuer);\n\
         mod inner {\n    #[test]\n    fn first() {\n        let Some(x) = needs::<Zk>(\"first\") else { return };\n    }\n}\n\
         #[test]\nfn second() {\n    let Some(e) = needs_etcd(\"second\") else { return };\n    let unneeded = 1;\n}\n",
    )
    .unwrap();
    let file = TestFile {
        path,
        package: "p".into(),
        binary: "b".into(),
        module: vec!["m".into()],
    };
    let found: Vec<String> = asking_tests(&file).into_iter().map(|(t, _)| t).collect();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found, ["m::", "m::inner::first", "m::second"]);

    let bodies = fn_bodies(
        "fn a() { if x { y(); } }\nfn decl();\nasync fn b(s: &str) -> u8 {\n    needs::<Etcd>(s).unwrap();\n}\n",
    );
    let names: Vec<&str> = bodies.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(bodies[0].1, "{ if x { y(); } }");
    assert!(bodies[1].1.contains("needs::<Etcd>(s).unwrap()"));
}
