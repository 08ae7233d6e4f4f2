//! Choosing group boundaries. A group's collective starts at
//! max(its GEMM done, previous collective's end) and takes its own cost
//! (longer while the GEMM runs beside it); its end never
//! decreases as the previous end grows, so the best layout of the bands after
//! a boundary depends only on the earliest time the bands before it can be
//! reduced: a dynamic programme over band boundaries is exact.

use crate::plan::error::{require_positive, PlanError};
use crate::plan::groups::GroupPartition;
use crate::plan::staged::StagedPartition;
use crate::plan::tiles::OutputTiles;
use crate::plan::waves::Waves;

use super::cost::{Beside, OverlapCost, StreamWork};
use super::hardware::HardwareModel;
use super::timeline::{predict, predict_staged, Timeline};

/// The partition with the smallest predicted overlap_us among those with at
/// most `max_groups` groups; on ties, the one with fewer groups.
pub fn best_partition(
    tiles: &OutputTiles,
    k: u32,
    ctas: u32,
    hw: &HardwareModel,
    world: u32,
    elem_bytes: u32,
    max_groups: u32,
) -> Result<(GroupPartition, Timeline), PlanError> {
    require_positive("max_groups", max_groups, PlanError::InvalidPartition)?;
    let cost = OverlapCost::new(tiles, k, ctas, hw, world, elem_bytes)?;
    let band_counts = BoundarySearch::new(&cost).counts(max_groups);
    let partition = GroupPartition::from_band_counts(tiles, &band_counts)?;
    let timeline = predict(tiles, k, ctas, &partition, hw, world, elem_bytes)?;
    Ok((partition, timeline))
}

/// The model's inputs at each unit boundary (row bands, or waves for the
/// staged schedule), tabulated once so the
/// quadratic inner loop is lookups; the tables hold the very values
/// `predict` computes, so the optimum matches its replay bit for bit.
struct BoundarySearch {
    units: usize,
    /// done[e]: GEMM finished units 0..e.
    done: Vec<f64>,
    /// span[d]: the stream's work for d full bands (groups not ending at the last band).
    span: Vec<StreamWork>,
    /// tail[s]: the stream's work for bands s.. to the end, whose last band may be partial.
    tail: Vec<StreamWork>,
    /// What each group costs beyond the pipeline (added per group to the time).
    group_us: f64,
    /// A collective's end from its start and its own time.
    beside: Beside,
}

/// The staged (swizzled) schedule's counterpart of [`best_partition`]:
/// groups are runs of whole waves, each with its un-reorder copy.
pub fn best_staged_partition(
    tiles: &OutputTiles,
    k: u32,
    ctas: u32,
    hw: &HardwareModel,
    world: u32,
    elem_bytes: u32,
    max_groups: u32,
) -> Result<(StagedPartition, Timeline), PlanError> {
    require_positive("max_groups", max_groups, PlanError::InvalidPartition)?;
    let cost = OverlapCost::new(tiles, k, ctas, hw, world, elem_bytes)?;
    let wave_counts = BoundarySearch::staged(&cost).counts(max_groups);
    let waves = Waves::new(ctas, tiles.count())?;
    let partition = StagedPartition::from_wave_counts(tiles, &waves, &wave_counts)?;
    let timeline = predict_staged(tiles, k, ctas, &partition, hw, world, elem_bytes)?;
    Ok((partition, timeline))
}

impl BoundarySearch {
    /// Tabulates `units` boundaries: done(e) when units 0..e are stored,
    /// comm(s, e) the collective of units s..e. A group of d whole units
    /// costs the same wherever it starts, so only groups ending at the last
    /// unit (which may be partial) need their own entry.
    fn tabulate(
        units: u32,
        cost: &OverlapCost,
        done: impl Fn(u32) -> f64,
        comm: impl Fn(u32, u32) -> StreamWork,
    ) -> Self {
        // Entry 0 of `done` and `span` (nothing finished, an empty group) is never read.
        let empty = StreamWork {
            collective_us: 0.0,
            then_us: 0.0,
        };
        Self {
            units: units as usize,
            done: std::iter::once(0.0).chain((1..=units).map(done)).collect(),
            span: std::iter::once(empty)
                .chain((1..units).map(|d| comm(0, d)))
                .collect(),
            tail: (0..units).map(|s| comm(s, units)).collect(),
            group_us: cost.group_us(),
            beside: cost.beside(),
        }
    }

    /// Units are waves of the staged schedule.
    fn staged(cost: &OverlapCost) -> Self {
        Self::tabulate(
            cost.wave_count(),
            cost,
            |e| cost.staged_done_us(e),
            |s, e| cost.staged_work(cost.staged_tiles(s..e)),
        )
    }

    /// Units are row bands.
    fn new(cost: &OverlapCost) -> Self {
        Self::tabulate(
            cost.band_count(),
            cost,
            |e| cost.gemm_done_us(e),
            |s, e| cost.group_work(s..e),
        )
    }

    fn work(&self, start: usize, end: usize) -> StreamWork {
        if end == self.units {
            self.tail[start]
        } else {
            self.span[end - start]
        }
    }

    /// Layer j of the programme holds, for every boundary e, the earliest
    /// last-collective end over layouts of bands 0..e in at most j+1 groups,
    /// and where that layout's last group starts. A layer that improves
    /// nothing means no further group can help, so the search stops there.
    /// Each group's cost beyond the pipeline is then weighed per layer: the
    /// layout of the layer whose end plus its groups' cost is least (the
    /// fewest groups on a tie) is the optimum of the whole objective, since
    /// a layer's layout is the earliest end for its group count or fewer.
    fn counts(&self, max_groups: u32) -> Vec<u32> {
        let n = self.units;
        let mut end: Vec<f64> = (0..=n)
            .map(|e| {
                if e == 0 {
                    0.0
                } else {
                    self.beside.end_us(self.done[e], self.work(0, e))
                }
            })
            .collect();
        let mut starts: Vec<Vec<usize>> = vec![vec![0; n + 1]];
        let mut ends = vec![end[n]];
        for _ in 1..max_groups.min(n as u32) {
            let mut next_end = end.clone();
            let mut next_start = starts[starts.len() - 1].clone();
            let mut improved = false;
            for e in 2..=n {
                // Moving the last group's start earlier only lengthens its
                // collective, so once that alone cannot win, nothing earlier can.
                for s in (1..e).rev() {
                    let work = self.work(s, e);
                    if self.beside.end_us(self.done[e], work) >= next_end[e] {
                        break;
                    }
                    let candidate = self.beside.end_us(self.done[e].max(end[s]), work);
                    if candidate < next_end[e] {
                        next_end[e] = candidate;
                        next_start[e] = s;
                        improved = true;
                    }
                }
            }
            if !improved {
                break;
            }
            end = next_end;
            ends.push(end[n]);
            starts.push(next_start);
        }
        let layouts = (1..=starts.len()).map(|layers| Self::walk_back(&starts[..layers], n));
        let objective =
            |(i, counts): &(usize, Vec<u32>)| ends[*i] + self.group_us * counts.len() as f64;
        layouts
            .enumerate()
            .min_by(|a, b| {
                objective(a)
                    .total_cmp(&objective(b))
                    .then(a.1.len().cmp(&b.1.len()))
            })
            .map(|(_, counts)| counts)
            .unwrap_or_else(|| vec![n as u32])
    }

    /// The layout of bands 0..n that the programme's `layers` found: walking
    /// back one layer per group keeps within the cap; a start carried over
    /// from a lower layer leads to a prefix at least as good.
    fn walk_back(layers: &[Vec<usize>], n: usize) -> Vec<u32> {
        let mut counts = Vec::new();
        let mut e = n;
        for layer in layers.iter().rev() {
            let s = layer[e];
            counts.push((e - s) as u32);
            e = s;
            if e == 0 {
                break;
            }
        }
        counts.reverse();
        counts
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::{ctas, output_tiles, world};
    use crate::plan::tiles::TileShape;

    const TILE: TileShape = TileShape {
        bm: 128,
        bn: 128,
        bk: 64,
    };

    fn overlap_us(
        tiles: &OutputTiles,
        k: u32,
        ctas: u32,
        hw: &HardwareModel,
        world: u32,
        counts: &[u32],
    ) -> f64 {
        let partition = GroupPartition::from_band_counts(tiles, counts).unwrap();
        predict(tiles, k, ctas, &partition, hw, world, 2)
            .unwrap()
            .overlap_us
    }

    /// The H200 model, its collectives `beside` times slower beside the GEMM.
    fn h200_beside(beside: f64) -> HardwareModel {
        HardwareModel {
            comm_beside_gemm: beside,
            ..HardwareModel::h200()
        }
    }

    /// Every composition of `bands` into at most `max_groups` parts.
    fn compositions(bands: u32, max_groups: u32) -> Vec<Vec<u32>> {
        (0u32..1 << (bands - 1))
            .filter(|cuts| cuts.count_ones() < max_groups)
            .map(|cuts| {
                let mut counts = vec![1];
                for band in 1..bands {
                    if cuts & (1 << (band - 1)) != 0 {
                        counts.push(1);
                    } else {
                        *counts.last_mut().unwrap() += 1;
                    }
                }
                counts
            })
            .collect()
    }

    #[test]
    fn zero_max_groups_is_rejected() {
        let tiles = OutputTiles::new(1024, 1024, TILE).unwrap();
        let result = best_partition(&tiles, 1024, 128, &HardwareModel::h200(), 2, 2, 0);
        assert!(
            matches!(result, Err(PlanError::InvalidPartition(why)) if why.starts_with("max_groups"))
        );
    }

    #[test]
    fn a_cost_per_group_is_weighed_against_the_pipeline() {
        let tiles = OutputTiles::new(16384, 8192, TILE).unwrap();
        let free = HardwareModel::h200();
        let (many, _) = best_partition(&tiles, 4096, 108, &free, 2, 2, 32).unwrap();
        for group_us in [8.0, 40.0, 400.0] {
            let hw = HardwareModel {
                overlap_group_us: group_us,
                ..free
            };
            let (few, timeline) = best_partition(&tiles, 4096, 108, &hw, 2, 2, 32).unwrap();
            assert!(few.len() <= many.len(), "{group_us} us per group");
            // The pick is no worse under the whole objective than the pipeline's own optimum.
            let other = predict(&tiles, 4096, 108, &many, &hw, 2, 2).unwrap();
            assert!(
                timeline.overlap_us <= other.overlap_us + 1e-9,
                "{group_us} us per group"
            );
            let last = timeline.groups.last().unwrap().comm_end_us;
            assert!((timeline.overlap_us - last - group_us * few.len() as f64).abs() < 1e-6);
        }
        // A prohibitive cost leaves one group.
        let hw = HardwareModel {
            overlap_group_us: 1e6,
            ..free
        };
        assert_eq!(
            best_partition(&tiles, 4096, 108, &hw, 2, 2, 32)
                .unwrap()
                .0
                .len(),
            1
        );
    }

    #[test]
    fn best_partition_time_per_call() {
        let tiles = OutputTiles::new(16384, 8192, TILE).unwrap();
        assert_eq!(tiles.tiles_m, 128);
        let hw = HardwareModel::h200();
        let calls = 100;
        let started = Instant::now();
        for _ in 0..calls {
            std::hint::black_box(best_partition(&tiles, 4096, 124, &hw, 2, 2, 128).unwrap());
        }
        let per_call_ms = started.elapsed().as_secs_f64() * 1e3 / f64::from(calls);
        let (partition, timeline) = best_partition(&tiles, 4096, 124, &hw, 2, 2, 128).unwrap();
        println!(
            "best_partition m=16384 n=8192 k=4096 world=2: {per_call_ms:.3} ms/call, {} groups, {:.1} us overlapped vs {:.1} us sequential",
            partition.len(),
            timeline.overlap_us,
            timeline.sequential_us
        );
        if !cfg!(debug_assertions) {
            assert!(per_call_ms < 1.0, "{per_call_ms} ms per call");
        }
    }

    proptest! {
        #[test]
        fn matches_exhaustive_search_on_few_bands(
            m in 1u32..=1280,
            n8 in 1u32..=2500,
            k in 1u32..16384,
            ctas in ctas(),
            world in world(),
            max_groups in 1u32..=10,
            beside in prop_oneof![Just(1.0), 1.0f64..2.0],
        ) {
            let tiles = OutputTiles::new(m, n8 * 8, TILE).unwrap();
            let hw = h200_beside(beside);
            let (partition, timeline) =
                best_partition(&tiles, k, ctas, &hw, world, 2, max_groups).unwrap();
            let optimum = compositions(tiles.tiles_m, max_groups)
                .iter()
                .map(|counts| overlap_us(&tiles, k, ctas, &hw, world, counts))
                .fold(f64::INFINITY, f64::min);
            prop_assert!(partition.len() as u32 <= max_groups);
            prop_assert_eq!(timeline.overlap_us, optimum);
        }

        #[test]
        fn staged_matches_exhaustive_search_on_few_waves(
            m in 1u32..=4096,
            n8 in 1u32..=1024,
            k in 1u32..16384,
            ctas in 8u32..=132,
            world in world(),
            max_groups in 1u32..=10,
            beside in prop_oneof![Just(1.0), 1.0f64..2.0],
        ) {
            let tiles = OutputTiles::new(m, n8 * 8, TILE).unwrap();
            let waves = Waves::new(ctas, tiles.count()).unwrap();
            prop_assume!(waves.count() <= 10);
            let hw = h200_beside(beside);
            let (partition, timeline) =
                best_staged_partition(&tiles, k, ctas, &hw, world, 2, max_groups).unwrap();
            let optimum = compositions(waves.count(), max_groups)
                .iter()
                .map(|counts| {
                    let p = StagedPartition::from_wave_counts(&tiles, &waves, counts).unwrap();
                    predict_staged(&tiles, k, ctas, &p, &hw, world, 2).unwrap().overlap_us
                })
                .fold(f64::INFINITY, f64::min);
            prop_assert!(partition.len() as u32 <= max_groups);
            prop_assert_eq!(timeline.overlap_us, optimum);
        }

        #[test]
        fn no_uniform_partition_beats_it(
            tiles in output_tiles(),
            k in 1u32..16384,
            ctas in ctas(),
            world in world(),
            max_groups in 1u32..=16,
            beside in prop_oneof![Just(1.0), 1.0f64..2.0],
        ) {
            let hw = h200_beside(beside);
            let (partition, timeline) = best_partition(&tiles, k, ctas, &hw, world, 2, max_groups).unwrap();
            prop_assert!(partition.len() as u32 <= max_groups);
            prop_assert_eq!(&timeline, &predict(&tiles, k, ctas, &partition, &hw, world, 2).unwrap());
            for per_group in 1..=tiles.tiles_m {
                let uniform = GroupPartition::uniform(&tiles, per_group).unwrap();
                if uniform.len() as u32 <= max_groups {
                    let t = predict(&tiles, k, ctas, &uniform, &hw, world, 2).unwrap();
                    prop_assert!(timeline.overlap_us <= t.overlap_us, "{} > {} for {per_group} bands per group", timeline.overlap_us, t.overlap_us);
                }
            }
        }
    }
}
