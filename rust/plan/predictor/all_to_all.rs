//! The GEMM + All-to-All schedule over every rank at once. Ranks carry
//! different amounts (MoE routing is skewed), and group g's exchange is one
//! grouped send/receive across all of them, so it starts when the slowest
//! rank has finished group g's tiles and the previous exchange, and lasts as
//! long as the busiest rank's traffic. Every rank evaluates the same split
//! matrix with the same model, so all of them choose the same group count,
//! which the exchange needs (plan/all_to_all.rs).

use crate::plan::all_to_all::{natural_band_counts, natural_phases, part_on, part_phased};
use crate::plan::error::{require_positive, PlanError};
use crate::plan::tiles::TileShape;

use super::cost::{Beside, StreamWork};
use super::hardware::HardwareModel;
use super::timeline::{GroupTiming, Timeline};

/// Most groups the search considers (the op's own limit).
pub const MAX_ALL_TO_ALL_GROUPS: u32 = 64;

/// One call's inputs on every rank: `matrix[p][q]` rows go from rank p to
/// rank q; the GEMM is [rows of p, k] x [k, n] on `ctas` CTAs of `tile`.
#[derive(Debug, Clone, Copy)]
pub struct AllToAllShape<'a> {
    pub matrix: &'a [Vec<u64>],
    pub n: u32,
    pub k: u32,
    pub elem_bytes: u32,
    pub tile: TileShape,
    pub ctas: u32,
    /// How the op tiles and splits each rank's rows.
    pub segments: Segments,
}

/// The layouts of plan::all_to_all, as the model counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segments {
    /// Each destination on its own bands, its parts whole bands of this
    /// many rows (plan::all_to_all::SEGMENT_ROWS; 1: the near-equal rows of
    /// runs measured before that).
    Padded(u64),
    /// One band grid over each rank's rows (the split matrix known).
    Natural,
}

impl AllToAllShape<'_> {
    fn validate(&self, hw: &HardwareModel) -> Result<(), PlanError> {
        hw.validate()?;
        for (field, value) in [
            ("n", self.n),
            ("k", self.k),
            ("elem_bytes", self.elem_bytes),
            ("tile.bm", self.tile.bm),
            ("tile.bn", self.tile.bn),
            ("ctas", self.ctas),
            (
                "segment_rows",
                u32::from(self.segments != Segments::Padded(0)),
            ),
        ] {
            require_positive(field, value, PlanError::InvalidShape)?;
        }
        let world = self.matrix.len();
        if world == 0 || self.matrix.iter().any(|row| row.len() != world) {
            return Err(PlanError::InvalidShape(format!(
                "split_matrix must be world x world with world >= 1, got {} rows of lengths {:?}",
                world,
                self.matrix.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        if self.ctas > hw.sms {
            return Err(PlanError::InvalidHardware(format!(
                "ctas must be <= sms = {}, got {}",
                hw.sms, self.ctas
            )));
        }
        Ok(())
    }

    fn world(&self) -> usize {
        self.matrix.len()
    }

    /// Rows p sends q in each group of `groups` (the plan's split of each
    /// segment), at `[(p * world + q) * groups + g]`: worked out once per
    /// group count, each segment's bounds once (a search asks for every
    /// group count, and the bounds take divisions).
    fn segments(&self, groups: u32) -> Vec<u64> {
        let world = self.world();
        let mut rows = Vec::with_capacity(world * world * groups as usize);
        for p in 0..world {
            // Where each destination's block starts on the sender's band grid (natural only).
            let phases = match self.segments {
                Segments::Padded(_) => vec![0; world],
                Segments::Natural => natural_phases(&self.matrix[p]),
            };
            for (&total, &phase) in self.matrix[p].iter().zip(&phases) {
                let bound = |g: u32| match self.segments {
                    Segments::Padded(unit) => part_on(total, 0, unit, g, groups),
                    Segments::Natural => part_phased(total, phase, g, groups),
                };
                let mut before = bound(0);
                for g in 0..groups {
                    let after = bound(g + 1);
                    rows.push(after - before);
                    before = after;
                }
            }
        }
        rows
    }

    /// Tiles each rank computes in each group ([rank][group]): padded, each
    /// destination's segment (`segments`, of this group count) in whole
    /// bands of its own; natural, the bands of the rank's grid that group
    /// computes first.
    fn group_tiles(&self, groups: u32, segments: &[u64]) -> Vec<Vec<u64>> {
        let bm = u64::from(self.tile.bm);
        let tiles_n = u64::from(self.n.div_ceil(self.tile.bn));
        let world = self.world();
        let g_count = groups as usize;
        (0..world)
            .map(|p| match self.segments {
                Segments::Padded(_) => (0..g_count)
                    .map(|g| {
                        (0..world)
                            .map(|q| segments[(p * world + q) * g_count + g].div_ceil(bm))
                            .sum::<u64>()
                            * tiles_n
                    })
                    .collect(),
                Segments::Natural => natural_band_counts(&self.matrix[p], groups, bm)
                    .iter()
                    .map(|&b| b * tiles_n)
                    .collect(),
            })
            .collect()
    }

    /// Bytes on the busiest rank's links (what it sends to or receives from
    /// others, whichever is more) when rank p sends `rows(p, q)` to q.
    fn busiest_bytes(&self, rows: impl Fn(usize, usize) -> u64) -> u64 {
        let world = self.world();
        let row_bytes = u64::from(self.n) * u64::from(self.elem_bytes);
        (0..world)
            .map(|r| {
                let sent: u64 = (0..world).filter(|&q| q != r).map(|q| rows(r, q)).sum();
                let received: u64 = (0..world).filter(|&p| p != r).map(|p| rows(p, r)).sum();
                sent.max(received) * row_bytes
            })
            .max()
            .unwrap_or(0)
    }

    /// The uniform All-to-All input per rank that puts `bytes` on each rank's
    /// links, which is what the model (and a measured curve) is keyed by.
    fn uniform_input(&self, bytes: u64) -> u64 {
        let world = self.world() as u64;
        if world <= 1 {
            return 0;
        }
        bytes * world / (world - 1)
    }
}

/// The timeline of `groups` groups: per group, when the last rank has
/// stored its tiles and when the exchange runs; `gemm_us` is the slowest
/// rank's overlapped GEMM, `sequential_us` the library GEMM on all SMs on
/// the slowest rank, then one All-to-All of everything.
pub fn predict_all_to_all(
    shape: &AllToAllShape,
    groups: u32,
    hw: &HardwareModel,
) -> Result<Timeline, PlanError> {
    shape.validate(hw)?;
    if !(1..=MAX_ALL_TO_ALL_GROUPS).contains(&groups) {
        return Err(PlanError::InvalidPartition(format!(
            "groups must be in 1..={MAX_ALL_TO_ALL_GROUPS}, got {groups}"
        )));
    }
    let world = shape.world();
    let tile_flops = 2.0 * f64::from(shape.tile.bm) * f64::from(shape.tile.bn) * f64::from(shape.k);
    let wave_us =
        hw.overlap_gemm_slowdown * tile_flops / (hw.gemm_tflops * 1e6 / f64::from(hw.sms));
    let ctas = u64::from(shape.ctas);
    let segments = shape.segments(groups);
    let tiles = shape.group_tiles(groups, &segments);
    let gemm_us = tiles
        .iter()
        .map(|t| t.iter().sum::<u64>().div_ceil(ctas) as f64 * wave_us)
        .fold(0.0, f64::max);
    let beside = Beside::new(gemm_us, hw.comm_beside_gemm);
    let mut stored = vec![0u64; world];
    let mut previous_end: f64 = 0.0;
    // Pushed: when the previous group's tiles and its pushes were done.
    let (mut previous_done, mut pushed_end): (f64, f64) = (0.0, 0.0);
    let mut timings = Vec::with_capacity(groups as usize);
    for g in 0..groups {
        let mut gemm_done_us: f64 = 0.0;
        for (p, done) in stored.iter_mut().enumerate() {
            *done += tiles[p][g as usize];
            gemm_done_us = gemm_done_us.max(done.div_ceil(ctas) as f64 * wave_us);
        }
        let at = |p: usize, q: usize| (p * world + q) * groups as usize + g as usize;
        let bytes = shape.busiest_bytes(|p, q| segments[at(p, q)]);
        let exchange_us = hw.overlap_comm_slowdown
            * hw.overlap_comm
                .time_us(shape.uniform_input(bytes), world as u32);
        // Pushed, the bytes cross as the group's tiles finish, unless the
        // links are slower than the GEMM makes them.
        let ready_us = match hw.pushed_link_gbps {
            Some(gbps) => {
                let link_us = bytes as f64 / (gbps * 1e3);
                pushed_end = gemm_done_us.max(previous_done.max(pushed_end) + link_us);
                previous_done = gemm_done_us;
                pushed_end
            }
            None => gemm_done_us,
        };
        let comm_start_us = ready_us.max(previous_end);
        previous_end = beside.end_us(
            comm_start_us,
            StreamWork {
                collective_us: exchange_us,
                then_us: 0.0,
            },
        );
        timings.push(GroupTiming {
            gemm_done_us,
            comm_start_us,
            comm_end_us: previous_end,
        });
    }
    let rows_max = shape
        .matrix
        .iter()
        .map(|r| r.iter().sum::<u64>())
        .max()
        .unwrap_or(0);
    let sequential_gemm_us = 2.0 * rows_max as f64 * f64::from(shape.n) * f64::from(shape.k)
        / (hw.sequential_gemm_tflops * 1e6);
    let all = shape.busiest_bytes(|p, q| shape.matrix[p][q]);
    let sequential_us =
        sequential_gemm_us + hw.comm.time_us(shape.uniform_input(all), world as u32);
    Ok(Timeline {
        groups: timings,
        gemm_us,
        overlap_us: previous_end.max(gemm_us) + f64::from(groups) * hw.overlap_group_us,
        sequential_us,
    })
}

/// A call's predicted time at `groups` groups: the timeline, plus what an
/// overlapped call pays once (`fixed_us`) when it has more than one group
/// (one group is the sequential schedule on this kernel).
pub fn call_us(groups: u32, t: &Timeline, fixed_us: f64) -> f64 {
    t.overlap_us + if groups > 1 { fixed_us } else { 0.0 }
}

/// Every group count 1..=max_groups with its predicted time, and the one
/// chosen: the fastest, more groups only when they save more than the
/// overlapped schedule's fixed cost (one group is the sequential schedule
/// on this kernel); ties go to fewer groups.
pub fn best_all_to_all_groups(
    shape: &AllToAllShape,
    hw: &HardwareModel,
    max_groups: u32,
) -> Result<(u32, Vec<(u32, Timeline)>), PlanError> {
    let max_groups = max_groups.clamp(1, MAX_ALL_TO_ALL_GROUPS);
    let timelines = (1..=max_groups)
        .map(|g| predict_all_to_all(shape, g, hw).map(|t| (g, t)))
        .collect::<Result<Vec<_>, _>>()?;
    let cost = |(g, t): &(u32, Timeline)| call_us(*g, t, hw.overlap_fixed_us);
    let best = timelines
        .iter()
        .min_by(|a, b| cost(a).total_cmp(&cost(b)).then(a.0.cmp(&b.0)))
        .map(|(g, _)| *g)
        .unwrap_or(1);
    Ok((best, timelines))
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use proptest::prelude::*;

    use super::*;
    use crate::plan::predictor::hardware::CollectiveModel;
    use crate::plan::testing::TILE;

    fn shape(matrix: &[Vec<u64>], n: u32, k: u32) -> AllToAllShape<'_> {
        AllToAllShape {
            matrix,
            n,
            k,
            elem_bytes: 2,
            tile: TILE,
            ctas: 120,
            segments: Segments::Padded(crate::plan::all_to_all::SEGMENT_ROWS),
        }
    }

    fn uniform(world: usize, rows: u64) -> Vec<Vec<u64>> {
        vec![vec![rows; world]; world]
    }

    #[test]
    fn one_group_is_the_gemm_then_the_exchange() {
        let hw = HardwareModel::h200();
        let m = uniform(2, 4096);
        let s = shape(&m, 8192, 4096);
        let t = predict_all_to_all(&s, 1, &hw).unwrap();
        // 8192 rows x 64 tile columns = 4096 tiles on 120 CTAs: 35 waves.
        let wave = 2.0 * 128.0 * 128.0 * 4096.0 / (hw.gemm_tflops * 1e6 / 132.0);
        assert!((t.gemm_us - 35.0 * wave).abs() < 1e-6);
        // Each rank sends 4096 rows of 16 KiB to the other.
        let bytes = 4096 * 8192 * 2;
        let exchange = hw.overlap_comm.time_us(2 * bytes, 2);
        assert!((t.overlap_us - (t.gemm_us + exchange)).abs() < 1e-6);
        assert_eq!(t.groups.len(), 1);
    }

    #[test]
    fn the_slowest_rank_sets_each_group_s_start() {
        let hw = HardwareModel::h200();
        // Rank 1 computes 8x the rows of rank 0: its GEMM gates every exchange.
        let skewed = vec![vec![512, 512], vec![4096, 4096]];
        let heavy = vec![vec![4096, 4096], vec![4096, 4096]];
        for g in 1..8 {
            let a = predict_all_to_all(&shape(&skewed, 8192, 8192), g, &hw).unwrap();
            let b = predict_all_to_all(&shape(&heavy, 8192, 8192), g, &hw).unwrap();
            for (x, y) in a.groups.iter().zip(&b.groups) {
                assert_eq!(x.gemm_done_us, y.gemm_done_us);
            }
        }
    }

    #[test]
    fn overlap_wins_on_large_compute_and_traffic() {
        let hw = HardwareModel::h200();
        let m = uniform(2, 8192);
        let (best, all) = best_all_to_all_groups(&shape(&m, 8192, 8192), &hw, 64).unwrap();
        assert!(best > 1, "{best}");
        let one = &all[0].1;
        let chosen = &all[best as usize - 1].1;
        assert!(chosen.overlap_us < one.overlap_us);
        assert_eq!(all.len(), 64);
    }

    #[test]
    fn a_cost_per_group_favours_fewer_groups() {
        let m = uniform(2, 16384);
        let s = shape(&m, 8192, 4096);
        let plain = HardwareModel::h200();
        let per_group = HardwareModel {
            overlap_group_us: 30.0,
            ..plain
        };
        let (many, _) = best_all_to_all_groups(&s, &plain, 64).unwrap();
        let (few, timelines) = best_all_to_all_groups(&s, &per_group, 64).unwrap();
        assert!(
            few < many,
            "{few} groups with a cost per group, {many} without"
        );
        // Each group count pays its groups' cost on top of the pipeline.
        for (g, t) in &timelines {
            let bare = predict_all_to_all(&s, *g, &plain).unwrap();
            assert!((t.overlap_us - bare.overlap_us - 30.0 * f64::from(*g)).abs() < 1e-6);
            assert_eq!(t.sequential_us, bare.sequential_us);
        }
    }

    #[test]
    fn a_fixed_cost_keeps_small_calls_in_one_group() {
        let hw = HardwareModel {
            overlap_fixed_us: 1e6,
            ..HardwareModel::h200()
        };
        let m = uniform(2, 8192);
        assert_eq!(
            best_all_to_all_groups(&shape(&m, 8192, 8192), &hw, 64)
                .unwrap()
                .0,
            1
        );
    }

    #[test]
    fn an_empty_exchange_costs_the_latency_only() {
        let hw = HardwareModel {
            overlap_comm: CollectiveModel::analytic(10.0, 100.0),
            ..HardwareModel::h200()
        };
        // Every rank keeps its rows: no link carries anything.
        let m = vec![vec![1000, 0], vec![0, 1000]];
        let t = predict_all_to_all(&shape(&m, 1024, 1024), 1, &hw).unwrap();
        assert!((t.overlap_us - t.gemm_us - 10.0).abs() < 1e-9);
    }

    #[test]
    fn bad_matrices_and_group_counts_are_named() {
        let hw = HardwareModel::h200();
        let ragged = vec![vec![1, 2], vec![3]];
        let err = predict_all_to_all(&shape(&ragged, 64, 64), 2, &hw).unwrap_err();
        assert!(err.to_string().contains("split_matrix"), "{err}");
        let m = uniform(2, 10);
        assert!(predict_all_to_all(&shape(&m, 64, 64), 0, &hw).is_err());
        assert!(predict_all_to_all(&shape(&m, 64, 64), 65, &hw).is_err());
        assert!(predict_all_to_all(&shape(&[], 64, 64), 1, &hw).is_err());
    }

    #[test]
    #[cfg_attr(
        debug_assertions,
        ignore = "a speed bar for release builds (tests/run.sh)"
    )]
    fn search_over_every_group_count_takes_under_five_milliseconds() {
        let hw = HardwareModel::h200();
        let matrix: Vec<Vec<u64>> = (0..8)
            .map(|p| (0..8).map(|q| 100 + 37 * p * q).collect())
            .collect();
        for segments in [
            Segments::Padded(crate::plan::all_to_all::SEGMENT_ROWS),
            Segments::Natural,
        ] {
            let s = AllToAllShape {
                segments,
                ..shape(&matrix, 8192, 4096)
            };
            // The fastest of 20: a busy machine slows some searches, not the search itself
            // (the mean of 20 once took 5.4 ms in CI beside a kernel compile).
            let per_search = (0..20)
                .map(|_| {
                    let start = Instant::now();
                    best_all_to_all_groups(&s, &hw, 64).unwrap();
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            println!(
                "all-to-all search, world 8, 64 candidates, {segments:?}: {:.1} us",
                per_search * 1e6
            );
            // Generous for a shared CI machine: the op searches on every call with new routing
            // (a release build here: ~1.3 ms padded, ~2.3 ms natural; 4.0 and 25.9 before the
            // segments and band counts were worked out once per group count).
            assert!(per_search < 5e-3, "{per_search}");
        }
    }

    proptest! {
        /// Invariants of the recurrence for any routing: exchanges run in
        /// order, never before their GEMM group, and the whole op is never
        /// shorter than the slowest rank's GEMM.
        #[test]
        fn exchanges_follow_their_groups(
            world in 1usize..=8,
            cells in prop::collection::vec(0u64..3000, 64),
            groups in 1u32..=16,
        ) {
            let matrix: Vec<Vec<u64>> = (0..world).map(|p| cells[p * 8..p * 8 + world].to_vec()).collect();
            let t = predict_all_to_all(&shape(&matrix, 4096, 2048), groups, &HardwareModel::h200()).unwrap();
            let mut previous = 0.0;
            for g in &t.groups {
                prop_assert!(g.comm_start_us >= g.gemm_done_us && g.comm_start_us >= previous);
                prop_assert!(g.comm_end_us >= g.comm_start_us);
                previous = g.comm_end_us;
            }
            prop_assert!(t.overlap_us >= t.gemm_us);
        }
    }
}
