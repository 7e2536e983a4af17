//! Configuration errors: each names the source, the document and the field to fix.

use std::fmt;

/// One problem found in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// File path or source name, with the document's position when known.
    pub source_name: String,
    /// `Kind namespace/name` of the document, or `document N` when it could not be read that far.
    pub document: String,
    /// Dotted path of the offending field (`spec.endpoints[1]`), empty for whole-document problems.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.source_name, self.document)?;
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Every problem found in one load, reported together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} configuration error(s)", self.0.len())?;
        for error in &self.0 {
            write!(f, "\n  {error}")?;
        }
        Ok(())
    }
}

impl ConfigErrors {
    pub fn iter(&self) -> impl Iterator<Item = &ConfigError> {
        self.0.iter()
    }

    /// Log each error as a structured line; for sources that keep serving their last good
    /// snapshot (the proxy's file watcher, the control process).
    pub fn log_rejected(&self) {
        for error in self.iter() {
            tracing::error!(
                source = %error.source_name,
                document = %error.document,
                field = %error.field,
                message = %error.message,
                "configuration rejected; keeping the last good snapshot"
            );
        }
    }
}
