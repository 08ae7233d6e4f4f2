//! Why a plan could not be made, split by what the caller has to fix: the
//! problem's shape, the group layout, or the description of the hardware.

use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum PlanError {
    /// Matrix dimensions, tile dimensions, element size or world size.
    InvalidShape(String),
    /// Wave-group layout or its limits.
    InvalidPartition(String),
    /// SM and CTA budget or the performance model's constants.
    InvalidHardware(String),
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidShape(why) => write!(f, "invalid shape: {why}"),
            Self::InvalidPartition(why) => write!(f, "invalid partition: {why}"),
            Self::InvalidHardware(why) => write!(f, "invalid hardware: {why}"),
        }
    }
}

impl std::error::Error for PlanError {}

/// Most limits are "at least one of these"; one helper keeps their messages alike.
pub(crate) fn require_positive(
    field: &str,
    value: u32,
    kind: fn(String) -> PlanError,
) -> Result<(), PlanError> {
    if value == 0 {
        Err(kind(format!("{field} must be >= 1, got 0")))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_kind_and_the_field() {
        let err = require_positive("k", 0, PlanError::InvalidShape).unwrap_err();
        assert_eq!(err, PlanError::InvalidShape("k must be >= 1, got 0".into()));
        assert_eq!(err.to_string(), "invalid shape: k must be >= 1, got 0");
        assert!(require_positive("k", 1, PlanError::InvalidShape).is_ok());
    }
}
