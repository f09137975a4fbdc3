//! `pgfence effect` from shell jobs under `pgfence run`, calling a real HTTP provider on
//! loopback with curl: the README's recipe. A second run of the job does not call again; a
//! zombie's late call carries the new holder's key and is deduplicated by the provider, and its
//! outcome is refused.

use crate::support;

use std::process::{Command, Output, Stdio};

use pgfence_testkit::Provider;
use support::{TestDb, unique_resource};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

/// The README's shell recipe: record the charge, call the provider with the key unless a
/// holder already recorded it, record the provider's answer.
const JOB: &str = r#"set -e
if key=$(pgfence effect begin --work "$ITEM" --step charge); then
  answer=$(curl -sS -X POST "$PROVIDER/charges" -H "Idempotency-Key: $key" -d "item=$ITEM&amount=100")
  pgfence effect finish --work "$ITEM" --step charge --outcome "$answer"
  echo "charged: $answer"
else
  status=$?
  [ "$status" -eq 3 ] || exit "$status"
  echo "already charged"
fi"#;

fn pgfence(env: &[(&str, &str)], args: &[&str]) -> Output {
    let dir = std::path::Path::new(BIN).parent().unwrap().to_owned();
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("REDIS_URL")
        .env_remove("PGFENCE_TOKEN")
        .env_remove("PGFENCE_RESOURCE")
        .env_remove("PGFENCE_OWNER")
        .env("PATH", path)
        .stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test]
async fn a_shell_job_charges_once_across_holders_and_zombies() {
    if std::process::Command::new("curl")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED a_shell_job_charges_once: curl is not installed");
        return;
    }
    let db = TestDb::new().await;
    let url = db.url();
    let provider = Provider::start(std::time::Duration::from_millis(20)).unwrap();
    let purl = provider.url();
    let res = unique_resource("cli-effect");
    let r = res.as_str();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("PGFENCE_ISSUER_URL", url.as_str()),
        ("PROVIDER", purl.as_str()),
        ("ITEM", "invoice-1"),
    ];
    let run = |env: &[(&str, &str)]| {
        pgfence(
            env,
            &[
                "run",
                "--resource",
                r,
                "--ttl",
                "10s",
                "--",
                "sh",
                "-c",
                JOB,
            ],
        )
    };
    let first = run(&env);
    assert!(first.status.success(), "{}", text(&first));
    assert!(
        String::from_utf8_lossy(&first.stdout).contains("charged: {\"id\":\"ch_1\""),
        "{}",
        text(&first)
    );
    // The job again (a retry, a new holder): the charge is recorded, no second call.
    let second = run(&env);
    assert!(second.status.success(), "{}", text(&second));
    assert!(
        String::from_utf8_lossy(&second.stdout).contains("already charged"),
        "{}",
        text(&second)
    );
    assert_eq!(provider.charges("invoice-1"), 1);
    let status = pgfence(
        &env,
        &[
            "effect",
            "status",
            r,
            "--work",
            "invoice-1",
            "--step",
            "charge",
            "--json",
        ],
    );
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["state"], "succeeded");
    assert_eq!(status["outcome"]["id"], "ch_1");

    // A zombie: lease A records the charge for invoice-2, then lease B takes over and runs
    // the job; A's late call carries the same key, and its outcome is refused.
    let acquired = pgfence(&env, &["lock", "acquire", r, "--ttl", "1s", "--json"]);
    let a: serde_json::Value = serde_json::from_slice(&acquired.stdout).unwrap();
    let (a_token, a_owner) = (
        a["token"].to_string(),
        a["owner"].as_str().unwrap().to_owned(),
    );
    let a_env = [
        ("DATABASE_URL", url.as_str()),
        ("PGFENCE_RESOURCE", r),
        ("PGFENCE_TOKEN", a_token.as_str()),
        ("PGFENCE_OWNER", a_owner.as_str()),
    ];
    let begun = pgfence(
        &a_env,
        &[
            "effect",
            "begin",
            "--work",
            "invoice-2",
            "--step",
            "charge",
            "--json",
        ],
    );
    assert!(begun.status.success(), "{}", text(&begun));
    let a_key: serde_json::Value = serde_json::from_slice(&begun.stdout).unwrap();
    assert_eq!(a_key["state"], "pending");
    let a_key = a_key["key"].as_str().unwrap().to_owned();
    let env2 = [
        ("DATABASE_URL", url.as_str()),
        ("PGFENCE_ISSUER_URL", url.as_str()),
        ("PROVIDER", purl.as_str()),
        ("ITEM", "invoice-2"),
    ];
    let b = pgfence(
        &env2,
        &[
            "run",
            "--resource",
            r,
            "--ttl",
            "10s",
            "--wait",
            "10s",
            "--",
            "sh",
            "-c",
            JOB,
        ],
    );
    assert!(b.status.success(), "{}", text(&b));
    // A wakes and calls with its key: the provider replays B's charge.
    let late = pgfence_testkit::provider::charge(
        &purl,
        Some(&a_key),
        "invoice-2",
        100,
        std::time::Duration::from_secs(5),
    )
    .unwrap();
    assert!(late.replayed, "{late:?}");
    assert_eq!(provider.charges("invoice-2"), 1, "one charge");
    let refused = pgfence(
        &a_env,
        &[
            "effect",
            "finish",
            "--work",
            "invoice-2",
            "--step",
            "charge",
            "--outcome",
            &late.body,
        ],
    );
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    let err = String::from_utf8_lossy(&refused.stderr);
    // The audit log event (WARN, as for every rejection), then the error.
    let lines: Vec<&str> = err.trim_end().lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].contains("pgfence::audit") && lines[0].contains("operation=\"effect_finish\""),
        "{err}"
    );
    assert!(lines[1].contains("stale fence token"), "{err}");
    // And A reaching its call point again is refused before calling.
    let again = pgfence(
        &a_env,
        &["effect", "begin", "--work", "invoice-2", "--step", "charge"],
    );
    assert_eq!(again.status.code(), Some(1), "{}", text(&again));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("do not make the call"),
        "{}",
        text(&again)
    );
    assert!(again.stdout.is_empty(), "no key printed");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pgfence.audit WHERE operation IN ('effect', 'effect_finish')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(audited, 2);
    assert!(provider.duplicates().is_empty());
}
