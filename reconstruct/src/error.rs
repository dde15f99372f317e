//! What can go wrong while reconstructing: reading the spool, writing traces.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("Arrow conversion: {0}")]
    Arrow(#[from] serde_arrow::Error),
    #[error("Arrow: {0}")]
    ArrowBatch(#[from] arrow_schema::ArrowError),
    #[error("Parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    #[error("spool: {0}")]
    Spool(#[from] tokentap_spool::SpoolError),
}
