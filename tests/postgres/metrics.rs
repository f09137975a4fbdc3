//! Metric labels are bounded: `pgfence_rejections_total` counts by operation, table, kind and
//! the resource's domain, never by resource name (which carries ids: a series per batch).

use crate::support;

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use pgfence::{Fencing, Repository, Resource, table::TableName};
use support::{TestDb, token};

#[derive(Debug, Clone, PartialEq)]
struct Job {
    id: i32,
    state: String,
}

pgfence::fenced_table!(Job { table: "metrics_job", key: id: i32, columns: [state] });

/// The process's Prometheus recorder (installed once for this test binary).
fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .install_recorder()
            .expect("install the Prometheus recorder")
    })
}

/// The `pgfence_rejections_total` series of this test's table.
fn rejection_series(handle: &PrometheusHandle) -> Vec<String> {
    handle
        .render()
        .lines()
        .filter(|l| l.starts_with("pgfence_rejections_total{") && l.contains("metrics_job"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn rejections_are_counted_by_operation_table_kind_and_domain() {
    let handle = recorder();
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE metrics_job (id int PRIMARY KEY, state text NOT NULL);
         INSERT INTO metrics_job VALUES (1, 'new'), (2, 'new');",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("metrics_job").unwrap())
        .await
        .unwrap();
    let repo = Repository::<Job>::new(db.pool.clone()).unwrap();
    let job = |id| Job {
        id,
        state: "done".into(),
    };

    // A stale write on a resource with an id in its name, and one in a fencing domain.
    let batch = Resource::new(format!("recon:batch:{}", rand::random::<u32>())).unwrap();
    let account = Resource::in_domain("billing", "account:7").unwrap();
    for (id, resource) in [(1, &batch), (2, &account)] {
        let newer = Fencing::new(token(10))
            .resource(resource.clone())
            .holder("b");
        repo.update(&db.pool, newer, &job(id)).await.unwrap();
        let older = Fencing::new(token(7))
            .resource(resource.clone())
            .holder("a");
        let err = repo.update(&db.pool, older, &job(id)).await.unwrap_err();
        assert!(err.is_stale(), "{err:?}");
    }
    // The same token from another holder: a duplicate.
    let twin = Fencing::new(token(10)).resource(batch.clone()).holder("c");
    let err = repo.update(&db.pool, twin, &job(1)).await.unwrap_err();
    assert!(err.is_duplicate(), "{err:?}");

    let series = rejection_series(handle);
    let has = |labels: &[&str]| {
        series
            .iter()
            .any(|line| labels.iter().all(|l| line.contains(l)))
    };
    assert!(
        has(&["operation=\"update\"", "kind=\"stale\"", "domain=\"recon\""]),
        "{series:#?}"
    );
    assert!(
        has(&[
            "operation=\"update\"",
            "kind=\"stale\"",
            "domain=\"billing\""
        ]),
        "{series:#?}"
    );
    assert!(
        has(&["kind=\"duplicate\"", "domain=\"recon\""]),
        "{series:#?}"
    );
    for line in &series {
        assert!(line.contains("table=\""), "{line}");
        assert!(!line.contains("resource="), "a resource label: {line}");
        assert!(
            !line.contains("batch:"),
            "a resource name in a label: {line}"
        );
    }
}
