//! The worker process the crate's tests start (`examples/zombie/worker.rs`), built only with
//! the internal `test-worker` feature, which the crate's own tests turn on. Not part of the
//! library.

#[path = "../../examples/zombie/worker.rs"]
mod worker;

#[tokio::main]
async fn main() -> Result<(), apalis_core::error::BoxDynError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    worker::run(&args).await
}
