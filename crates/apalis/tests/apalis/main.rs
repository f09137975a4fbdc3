//! pgfence-apalis's tests, one binary: the layer on its own (`layer`), and the zombie scenario
//! with real apalis-postgres worker processes (`zombie`). PostgreSQL from `DATABASE_URL`, or a
//! throwaway server (see `pgfence_testkit`); each test gets a fresh database.

use pgfence_test_support as support;

#[path = "../../examples/zombie/scenario.rs"]
mod scenario;
#[path = "../../examples/zombie/worker.rs"]
mod worker;

mod layer;
mod zombie;
