//! The numbers a lock service's token counter must stay above: [`high_water`] of a resource
//! and [`counter_floor`] of the counter it draws from.

use sqlx::PgExecutor;

use crate::{Resource, Result};

/// The token of the newest lease that checked `resource` (0 when none): the floor its token
/// counter must stay above. For the marks of an issuer with a key prefix other than the
/// default, pass that prefix's name ([`Resource::in_key_prefix`],
/// [`Lease::fencing_resource`](crate::Lease::fencing_resource)).
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend).
pub async fn high_water<'c, E: PgExecutor<'c>>(exec: E, resource: &Resource) -> Result<i64> {
    let mark = sqlx::query_scalar!(
        r#"SELECT pgfence.high_water($1) AS "mark!""#,
        resource.as_str()
    )
    .fetch_one(exec)
    .await?;
    Ok(mark)
}

/// The floor of the token counter `resource` draws from: [`high_water`] for a resource of
/// its own, the highest mark of every resource of its fencing domain otherwise. As for
/// [`high_water`], a key prefix's marks are read under its name ([`Resource::in_key_prefix`]:
/// the domain `D` of prefix `P` is `P{D`).
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend).
pub async fn counter_floor<'c, E: PgExecutor<'c>>(exec: E, resource: &Resource) -> Result<i64> {
    let Some(domain) = resource.domain() else {
        return high_water(exec, resource).await;
    };
    let mark = sqlx::query_scalar!(r#"SELECT pgfence.domain_high_water($1) AS "mark!""#, domain)
        .fetch_one(exec)
        .await?;
    Ok(mark)
}
