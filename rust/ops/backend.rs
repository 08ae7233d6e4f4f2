//! What moves an op's bytes, and which backend "auto" runs: the one whose
//! plan the predictor times fastest for the shape at hand (from the
//! profiles `flashoverlap tune` measured for both where they exist, else
//! from the constants), so that no shape pays for a backend that loses on it.

use crate::error::{Error, Result};

/// What moves the bytes of each group's collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// NCCL on the comm stream (CTAs on the reserved SMs).
    Nccl,
    /// Copy-engine copies into peers' staging slots plus a reduction on
    /// the reserved SMs; ranks of one node with peer access only.
    CopyEngine,
    /// gemm_all_reduce_rmsnorm only: each rank's GEMM stores its partial in
    /// its own peer buffer, and one kernel per group on the reserved SMs
    /// sums each owner's slice of the group's rows from every rank (NVLink
    /// loads), adds the residual, normalizes and stores the rows into every
    /// rank (csrc/allreduce_rmsnorm.cu, pull mode); one node only.
    Peer,
    /// The GEMM ops (gemm_all_reduce, gemm_reduce_scatter,
    /// gemm_all_reduce_rmsnorm, gemm_all_to_all) on 2 ranks of one node with
    /// the sm_90 GEMM: its epilogue stores tiles into the peer's staging
    /// slot (TMA over NVLink, while the GEMM goes on): every tile for an
    /// AllReduce (and locally too), those of the peer's shard for a
    /// ReduceScatter and of the peer's rows for an All-to-All (instead);
    /// each counts in the peer's ready flag of its group. Each group is then
    /// summed by the copy-engine backend's reduction on the reserved SMs
    /// (All-to-All: the landed rows are copied into the output). No copy to
    /// the peer, no copy stream.
    Push,
}

impl Backend {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "nccl" => Some(Backend::Nccl),
            "copy_engine" => Some(Backend::CopyEngine),
            "peer" => Some(Backend::Peer),
            "push" => Some(Backend::Push),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Nccl => "nccl",
            Backend::CopyEngine => "copy_engine",
            Backend::Peer => "peer",
            Backend::Push => "push",
        }
    }

    /// The error of an op that has no `Peer` path (every op but the fused norm).
    pub fn peer_unsupported(op: &str) -> Error {
        Error::Invalid(format!(
            "backend: 'peer' runs gemm_all_reduce_rmsnorm only, not {op}; use 'nccl', 'copy_engine' or 'auto'"
        ))
    }
}

/// Of `allowed`, the backend with the lowest predicted time `cost(b)` (in
/// microseconds); a tie goes to the one listed first. With one backend
/// allowed nothing is predicted.
pub fn cheapest(
    allowed: &[Backend],
    mut cost: impl FnMut(Backend) -> Result<f64>,
) -> Result<Backend> {
    match allowed {
        [] => Err(Error::Invalid(
            "backend: no backend can run on this communicator".into(),
        )),
        [only] => Ok(*only),
        _ => {
            let mut best: Option<(Backend, f64)> = None;
            for &b in allowed {
                let us = cost(b)?;
                if best.map_or(true, |(_, t)| us < t) {
                    best = Some((b, us));
                }
            }
            Ok(best.expect("allowed is not empty").0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cheapest_wins_and_ties_go_to_the_first() {
        let both = [Backend::Nccl, Backend::CopyEngine];
        let ce_faster = |b| Ok(if b == Backend::CopyEngine { 10.0 } else { 20.0 });
        assert_eq!(cheapest(&both, ce_faster).unwrap(), Backend::CopyEngine);
        assert_eq!(cheapest(&both, |_| Ok(5.0)).unwrap(), Backend::Nccl);
        let mut asked = 0;
        let only = cheapest(&[Backend::CopyEngine], |_| {
            asked += 1;
            Ok(1.0)
        });
        assert_eq!((only.unwrap(), asked), (Backend::CopyEngine, 0));
        assert!(cheapest(&[], |_| Ok(1.0)).is_err());
        let failing = cheapest(&both, |_| Err(Error::Invalid("no plan".into())));
        assert!(failing.is_err());
    }

    #[test]
    fn names_round_trip() {
        for b in [
            Backend::Nccl,
            Backend::CopyEngine,
            Backend::Peer,
            Backend::Push,
        ] {
            assert_eq!(Backend::parse(b.name()), Some(b));
        }
        assert_eq!(Backend::parse("auto"), None);
    }
}
