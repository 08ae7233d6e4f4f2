//! Replaying a partition through the model: when each group's tiles are all
//! stored, and when its collective can start and end on the single
//! communication stream.

use crate::plan::error::PlanError;
use crate::plan::groups::GroupPartition;
use crate::plan::staged::StagedPartition;
use crate::plan::tiles::OutputTiles;
use crate::plan::waves::Waves;

use super::cost::{OverlapCost, StreamWork};
use super::hardware::HardwareModel;

#[derive(Debug, Clone, PartialEq)]
pub struct GroupTiming {
    pub gemm_done_us: f64,
    pub comm_start_us: f64,
    pub comm_end_us: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    pub groups: Vec<GroupTiming>,
    pub gemm_us: f64,
    /// End of the last collective, plus what every group costs beyond the
    /// pipeline (`overlap_group_us` each): the predicted time of the whole op.
    pub overlap_us: f64,
    pub sequential_us: f64,
}

impl Timeline {
    /// What the groups add on top of the last collective's end (an
    /// AllReduce or ReduceScatter timeline; 0 for a sequential one).
    pub fn groups_overhead_us(&self) -> f64 {
        self.groups
            .last()
            .map_or(0.0, |g| (self.overlap_us - g.comm_end_us).max(0.0))
    }
}

/// GEMM time on `ctas` CTAs: tiles are processed in waves; wave time = flops
/// of one wave of full tiles / (gemm_tflops * ctas/sms); group g's GEMM is done
/// at the end of the wave containing its last position (times
/// overlap_gemm_slowdown). Comm of group g starts at max(gemm_done_g,
/// comm_end_{g-1}) and lasts overlap_comm_slowdown * the collective's time_us(bytes of its
/// slice), comm_beside_gemm times longer while the GEMM still runs. overlap_us = last
/// comm_end + groups * overlap_group_us. sequential_us = the library GEMM
/// (sequential_gemm_tflops) + the collective over the whole output.
pub fn predict(
    tiles: &OutputTiles,
    k: u32,
    ctas: u32,
    partition: &GroupPartition,
    hw: &HardwareModel,
    world: u32,
    elem_bytes: u32,
) -> Result<Timeline, PlanError> {
    let cost = OverlapCost::new(tiles, k, ctas, hw, world, elem_bytes)?;
    partition.check_against(tiles)?;
    let timings = partition.groups.iter().map(|group| {
        (
            cost.gemm_done_us(group.bands.end),
            cost.group_work(group.bands.clone()),
        )
    });
    Ok(replay(timings, &cost))
}

/// The staged (swizzled) schedule's timeline: group g's GEMM is done at the
/// end of its last wave; its collective covers its whole staged tiles and is
/// followed on the same stream by their un-reorder copy.
pub fn predict_staged(
    tiles: &OutputTiles,
    k: u32,
    ctas: u32,
    partition: &StagedPartition,
    hw: &HardwareModel,
    world: u32,
    elem_bytes: u32,
) -> Result<Timeline, PlanError> {
    let cost = OverlapCost::new(tiles, k, ctas, hw, world, elem_bytes)?;
    let waves = Waves::new(ctas, tiles.count())?;
    StagedPartition::from_wave_counts(tiles, &waves, &partition.wave_counts())
        .ok()
        .filter(|p| p == partition)
        .ok_or_else(|| {
            PlanError::InvalidPartition(format!(
                "staged groups must be the wave ranges of {ctas} CTAs over {} tiles",
                tiles.count()
            ))
        })?;
    let timings = partition
        .groups
        .iter()
        .map(|g| (cost.staged_done_us(g.waves.end), cost.staged_work(g.tiles)));
    Ok(replay(timings, &cost))
}

/// The combined-stores schedule of a ReduceScatter (push or copy engines,
/// 2 ranks): no collective after the GEMM. The tiles run in
/// [`combined_sequence`] order with `lead` positions between a group's
/// last tile of the peers' shards and its first own tile. Group g's partial
/// for the peer crosses the link behind the previous group's, taking the
/// link time of its bytes (`overlap_comm`, as a ReduceScatter of the group):
/// pushed from the epilogue (`push_drain_stall`), from its first tile on,
/// arriving no earlier than its last tile is stored, each pushed tile
/// stalling its CTA (and, the waves being in step, every later position)
/// for its share of the link; copied, from when its last tile is stored.
/// An own tile done before its group's partial arrived waits, and delays
/// every later position by as much. Per group the timing
/// reports when its last own tile is stored (gemm_done), the start of its
/// transfer and its arrival.
///
/// `gather` (an AllReduce on 2 ranks as this ReduceScatter and a gather):
/// each group's own sums then cross the link too, as many bytes as its
/// partial, pushed as they are stored (each own tile stalling its CTA for
/// `sums_stall` times its share of the link) or copied once the group's
/// last own tile is stored; the receiver
/// copies them into its output at `land_gbps` (one group after another),
/// and the group's fused norm, where one follows, runs after that on the
/// SMs the GEMM leaves free, or, with none free, once the GEMM is done, on
/// every SM. A group's timing then reports the gather's arrival (landed and
/// normed) as its end.
#[allow(clippy::too_many_arguments)]
pub fn predict_combined(
    tiles: &OutputTiles,
    k: u32,
    ctas: u32,
    partition: &GroupPartition,
    hw: &HardwareModel,
    world: u32,
    elem_bytes: u32,
    lead: u32,
    gather: Option<Gather>,
) -> Result<Timeline, PlanError> {
    let cost = OverlapCost::new(tiles, k, ctas, hw, world, elem_bytes)?;
    partition.check_against(tiles)?;
    let world = world.max(1);
    // (tiles of the peers' shards, own tiles) per group, and the link time.
    let counts: Vec<(u32, u32)> = partition
        .groups
        .iter()
        .map(|g| {
            let count = (g.bands.end - g.bands.start) * tiles.tiles_n;
            (count - count / world, count / world)
        })
        .collect();
    let link_us: Vec<f64> = partition
        .groups
        .iter()
        .map(|g| match gather {
            Some(_) => cost.link_us(g.bands.clone()),
            None => cost.comm_us(g.bands.clone()),
        })
        .collect();
    let drain = hw.push_drain_stall;
    let zero = GroupTiming {
        gemm_done_us: -1.0,
        comm_start_us: -1.0,
        comm_end_us: 0.0,
    };
    let mut timings = vec![zero; counts.len()];
    // The gather's (first own tile stored, sums' arrival) per group.
    let mut sums = vec![(-1.0f64, 0.0f64); counts.len()];
    let mut left: Vec<u32> = counts.iter().map(|c| c.0).collect();
    let mut own_left: Vec<u32> = counts.iter().map(|c| c.1).collect();
    let (mut delay, mut link_free, mut end) = (0.0f64, 0.0f64, 0.0f64);
    for (q, (g, own)) in (0u32..).zip(combined_sequence(&counts, lead)) {
        let g = g as usize;
        let mut done = cost.position_done_us(q) + delay;
        let t = &mut timings[g];
        if own {
            if t.comm_end_us > done {
                delay += t.comm_end_us - done;
                done = t.comm_end_us;
            }
            if let Some(gather) = gather {
                if let Some(stall) = gather.sums_stall {
                    let wait = stall * link_us[g] / f64::from(counts[g].1.max(1));
                    delay += wait;
                    done += wait;
                }
                if sums[g].0 < 0.0 {
                    sums[g].0 = done;
                }
                own_left[g] -= 1;
                if own_left[g] == 0 {
                    // Pushed sums stream from the group's first own tile on;
                    // copied ones leave once its last is stored.
                    let start = if gather.sums_stall.is_some() {
                        sums[g].0
                    } else {
                        done
                    };
                    sums[g].1 = done.max(start.max(link_free) + link_us[g]);
                    link_free = sums[g].1;
                }
            }
            t.gemm_done_us = t.gemm_done_us.max(done);
        } else {
            if let Some(stall) = drain {
                let wait = stall * link_us[g] / f64::from(counts[g].0);
                delay += wait;
                done += wait;
            }
            if t.comm_start_us < 0.0 && drain.is_some() {
                t.comm_start_us = done.max(link_free);
            }
            left[g] -= 1;
            if left[g] == 0 {
                if drain.is_none() {
                    t.comm_start_us = done.max(link_free);
                }
                t.comm_end_us = done.max(t.comm_start_us + link_us[g]);
                if gather.is_some() {
                    // The sums of earlier groups stream on the same link
                    // meanwhile: this partial's bytes follow theirs.
                    t.comm_end_us = t.comm_end_us.max(link_free + link_us[g]);
                }
                link_free = t.comm_end_us;
            }
        }
        end = end.max(done);
    }
    if let Some(gather) = gather {
        // The GEMM is done at `end`; then each group lands and is normed in turn.
        let gemm_end = end;
        let free = cost.free_sms();
        let (mut land_free, mut norm_free) = (0.0f64, 0.0f64);
        for (g, group) in partition.groups.iter().enumerate() {
            let landed_bytes = cost.group_bytes(group.bands.clone()) / u64::from(world);
            let landed = sums[g].1.max(land_free) + landed_bytes as f64 / (gather.land_gbps * 1e3);
            land_free = landed;
            let normed = if free == 0 {
                landed.max(gemm_end).max(norm_free) + cost.norm_us(group.bands.clone(), hw.sms)
            } else {
                landed.max(norm_free) + cost.norm_us(group.bands.clone(), free)
            };
            norm_free = normed;
            timings[g].comm_end_us = normed;
            end = end.max(normed);
        }
    }
    Ok(Timeline {
        gemm_us: cost.gemm_us(),
        overlap_us: end + counts.len() as f64 * cost.group_us(),
        sequential_us: cost.sequential_us(),
        groups: timings,
    })
}

/// A combined AllReduce's gather ([`predict_combined`]): each rank copies
/// the peer's sums from its slot into its output at `land_gbps` (GB/s of
/// landed bytes; infinite where nothing lands, a fused norm reading the
/// slot instead); `all_reduce` times the AllReduce that the sequential
/// schedule runs instead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gather {
    pub land_gbps: f64,
    pub all_reduce: super::hardware::CollectiveModel,
    /// Some(f): the sums are pushed from the epilogue, each own tile
    /// stalling its CTA for f times its share of the group's link time;
    /// None: copied once the group's own tiles are stored.
    pub sums_stall: Option<f64>,
    /// A fused norm follows each group (gemm_all_reduce_rmsnorm).
    pub norm: bool,
}

/// The order of a combined-stores GEMM's tiles, (group, own tile?) per
/// position, from each group's (tiles of the peers' shards, own tiles):
/// the peers' tiles group by group, and merged evenly among them each
/// group's own tiles, none before `lead` positions after the group's last
/// tile of the peers' shards, so that the partials they add have crossed
/// the link by then (the own tiles wait for them); what is left after the
/// last peers' tile follows in group order. The same on every rank, which
/// is what makes each wait one for tiles earlier in the peer's order.
pub fn combined_sequence(counts: &[(u32, u32)], lead: u32) -> Vec<(u32, bool)> {
    let (total_pushed, total_own) = counts.iter().fold((0u64, 0u64), |(a, b), c| {
        (a + u64::from(c.0), b + u64::from(c.1))
    });
    let mut order = Vec::with_capacity((total_pushed + total_own) as usize);
    // Where each group's last tile of the peers' shards ended (its position + 1).
    let mut pushed_end: Vec<Option<u64>> = vec![None; counts.len()];
    let (mut p, mut p_taken, mut o, mut o_taken) = (0usize, 0u32, 0usize, 0u32);
    let (mut pushed_done, mut own_done) = (0u64, 0u64);
    while order.len() < (total_pushed + total_own) as usize {
        while p < counts.len() && p_taken == counts[p].0 {
            pushed_end[p] = Some(order.len() as u64);
            p += 1;
            p_taken = 0;
        }
        while o < counts.len() && o_taken == counts[o].1 {
            o += 1;
            o_taken = 0;
        }
        let position = order.len() as u64;
        let own_ready =
            o < counts.len() && pushed_end[o].is_some_and(|e| position >= e + u64::from(lead));
        // Own tiles that fell behind their share of the positions go next.
        let own_turn = own_done * total_pushed <= pushed_done * total_own;
        let take_own = p == counts.len() || (own_ready && own_turn);
        if take_own {
            order.push((o as u32, true));
            o_taken += 1;
            own_done += 1;
        } else {
            order.push((p as u32, false));
            p_taken += 1;
            pushed_done += 1;
        }
    }
    order
}

/// Runs the collectives one after another on the stream, each from when its
/// group's GEMM is done (slowed while the GEMM runs beside it): (gemm done,
/// its work on the stream) per group.
fn replay(groups: impl Iterator<Item = (f64, StreamWork)>, cost: &OverlapCost) -> Timeline {
    let beside = cost.beside();
    let mut previous_end = 0.0;
    let groups: Vec<GroupTiming> = groups
        .map(|(gemm_done_us, work)| {
            let comm_start_us = gemm_done_us.max(previous_end);
            previous_end = beside.end_us(comm_start_us, work);
            GroupTiming {
                gemm_done_us,
                comm_start_us,
                comm_end_us: previous_end,
            }
        })
        .collect();
    Timeline {
        gemm_us: cost.gemm_us(),
        // Each group's cost that the pipeline does not hide comes on top.
        overlap_us: previous_end + groups.len() as f64 * cost.group_us(),
        sequential_us: cost.sequential_us(),
        groups,
    }
}

/// The baseline as a one-group timeline: the library GEMM, then one
/// AllReduce of the whole output, so a sequential plan reports in the same
/// terms as an overlapped one; its `overlap_us` equals its `sequential_us`.
pub fn predict_sequential(
    tiles: &OutputTiles,
    k: u32,
    hw: &HardwareModel,
    world: u32,
    elem_bytes: u32,
) -> Result<Timeline, PlanError> {
    let cost = OverlapCost::new(tiles, k, hw.sms, hw, world, elem_bytes)?;
    let sequential_us = cost.sequential_us();
    let gemm_us = cost.sequential_gemm_us();
    Ok(Timeline {
        groups: vec![GroupTiming {
            gemm_done_us: gemm_us,
            comm_start_us: gemm_us,
            comm_end_us: sequential_us,
        }],
        gemm_us,
        overlap_us: sequential_us,
        sequential_us,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::{ctas, output_tiles, tiles as shape, world};

    fn uniform(tiles: &OutputTiles, k: u32, ctas: u32, per_group: u32, n_world: u32) -> Timeline {
        let partition = GroupPartition::uniform(tiles, per_group).unwrap();
        predict(
            tiles,
            k,
            ctas,
            &partition,
            &HardwareModel::h200(),
            n_world,
            2,
        )
        .unwrap()
    }

    proptest! {
        #[test]
        fn combined_sequence_keeps_the_lead(
            counts in prop::collection::vec((1u32..300, 1u32..300), 1..12),
            lead in 0u32..400,
        ) {
            let order = combined_sequence(&counts, lead);
            let total: u32 = counts.iter().map(|c| c.0 + c.1).sum();
            prop_assert_eq!(order.len() as u32, total);
            let mut last_pushed = vec![None; counts.len()];
            let mut seen = vec![(0u32, 0u32); counts.len()];
            for (q, &(g, own)) in order.iter().enumerate() {
                let g = g as usize;
                if own {
                    seen[g].1 += 1;
                    // Every tile of the group's partial came first, `lead` before
                    // (unless nothing else was left to compute).
                    prop_assert_eq!(seen[g].0, counts[g].0);
                    let all_pushed = seen.iter().zip(&counts).all(|(s, c)| s.0 == c.0);
                    prop_assert!(q >= last_pushed[g].unwrap() + 1 + lead as usize || all_pushed);
                } else {
                    // Groups' partials in order.
                    prop_assert!(seen[..g].iter().zip(&counts).all(|(s, c)| s.0 == c.0));
                    seen[g].0 += 1;
                    last_pushed[g] = Some(q);
                }
            }
            prop_assert!(seen.iter().zip(&counts).all(|(s, c)| *s == *c));
        }
    }

    #[test]
    fn a_combined_call_waits_where_the_link_is_slower_than_the_gemm() {
        let tiles = shape(2048, 16384);
        let p = GroupPartition::uniform(&tiles, 2).unwrap();
        let run = |gbps: f64| {
            let hw = HardwareModel {
                overlap_comm: crate::plan::CollectiveModel::analytic(5.0, gbps),
                ..HardwareModel::h200()
            };
            predict_combined(&tiles, 1024, 132, &p, &hw, 2, 2, 132, None).unwrap()
        };
        let (fast, slow) = (run(2000.0), run(50.0));
        // A fast link hides the partials behind the GEMM; a slow one sets the pace.
        assert!(fast.overlap_us < fast.gemm_us * 1.2);
        assert!(slow.overlap_us > fast.overlap_us * 2.0);
        for t in &slow.groups {
            assert!(t.gemm_done_us >= t.comm_end_us);
        }
    }

    #[test]
    fn more_k_means_a_longer_gemm() {
        let tiles = shape(4096, 8192);
        let short = uniform(&tiles, 1024, 120, 4, 8);
        let long = uniform(&tiles, 4096, 120, 4, 8);
        assert!(long.gemm_us > short.gemm_us);
        assert!(long.sequential_us > short.sequential_us);
        assert!(long.groups[0].gemm_done_us > short.groups[0].gemm_done_us);
    }

    #[test]
    fn wider_output_means_longer_collectives() {
        let (narrow, wide) = (
            uniform(&shape(4096, 4096), 4096, 120, 4, 8),
            uniform(&shape(4096, 8192), 4096, 120, 4, 8),
        );
        let duration = |t: &GroupTiming| t.comm_end_us - t.comm_start_us;
        for (a, b) in narrow.groups.iter().zip(&wide.groups) {
            assert!(duration(b) > duration(a));
        }
    }

    #[test]
    fn only_collectives_beside_the_gemm_are_slowed() {
        let tiles = shape(4096, 8192);
        let run = |beside: f64, per_group: u32| {
            let hw = HardwareModel {
                comm_beside_gemm: beside,
                ..HardwareModel::h200()
            };
            let p = GroupPartition::uniform(&tiles, per_group).unwrap();
            predict(&tiles, 4096, 120, &p, &hw, 2, 2).unwrap()
        };
        // One group starts once the GEMM is done: nothing to slow.
        assert_eq!(run(1.0, 32).overlap_us, run(1.5, 32).overlap_us);
        let (alone, beside) = (run(1.0, 8), run(1.5, 8));
        let duration = |t: &GroupTiming| t.comm_end_us - t.comm_start_us;
        let first = (duration(&alone.groups[0]), duration(&beside.groups[0]));
        assert!((first.1 - 1.5 * first.0).abs() < 1e-9, "{first:?}");
        let last = (alone.groups.last().unwrap(), beside.groups.last().unwrap());
        assert!(last.1.comm_start_us >= beside.gemm_us);
        assert!((duration(last.0) - duration(last.1)).abs() < 1e-9);
    }

    #[test]
    fn fewer_ctas_mean_more_waves() {
        let tiles = shape(4096, 8192);
        assert!(uniform(&tiles, 4096, 66, 4, 8).gemm_us > uniform(&tiles, 4096, 132, 4, 8).gemm_us);
    }

    #[test]
    fn sequential_timeline_is_the_baseline() {
        let tiles = shape(3000, 5000);
        let timeline = predict_sequential(&tiles, 2048, &HardwareModel::h200(), 4, 2).unwrap();
        assert_eq!(timeline.groups.len(), 1);
        assert_eq!(timeline.overlap_us, timeline.sequential_us);
        assert_eq!(timeline.groups[0].gemm_done_us, timeline.gemm_us);
    }

    #[test]
    fn bad_inputs_are_rejected() {
        let tiles = shape(1024, 1024);
        let hw = HardwareModel::h200();
        let partition = GroupPartition::uniform(&tiles, 2).unwrap();
        let other = GroupPartition::uniform(&shape(2048, 1024), 2).unwrap();
        assert!(matches!(
            predict(&tiles, 64, 133, &partition, &hw, 2, 2),
            Err(PlanError::InvalidHardware(_))
        ));
        assert!(matches!(
            predict(&tiles, 64, 0, &partition, &hw, 2, 2),
            Err(PlanError::InvalidHardware(_))
        ));
        assert!(matches!(
            predict(&tiles, 0, 64, &partition, &hw, 2, 2),
            Err(PlanError::InvalidShape(_))
        ));
        assert!(matches!(
            predict(&tiles, 64, 64, &partition, &hw, 2, 0),
            Err(PlanError::InvalidShape(_))
        ));
        assert!(matches!(
            predict(&tiles, 64, 64, &other, &hw, 2, 2),
            Err(PlanError::InvalidPartition(_))
        ));
    }

    proptest! {
        #[test]
        fn timeline_follows_the_recurrence(
            tiles in output_tiles(),
            k in 1u32..16384,
            ctas in ctas(),
            world in world(),
            per_group in 1u32..64,
        ) {
            let timeline = uniform(&tiles, k, ctas, per_group, world);
            let mut previous_end = 0.0;
            let mut previous_done = 0.0;
            for group in &timeline.groups {
                prop_assert!(group.gemm_done_us >= previous_done);
                prop_assert!(group.comm_start_us >= group.gemm_done_us);
                prop_assert!(group.comm_start_us >= previous_end);
                prop_assert!(group.comm_start_us == group.gemm_done_us || group.comm_start_us == previous_end);
                prop_assert!(group.comm_end_us > group.comm_start_us);
                previous_end = group.comm_end_us;
                previous_done = group.gemm_done_us;
            }
            prop_assert_eq!(previous_done, timeline.gemm_us);
            prop_assert_eq!(previous_end, timeline.overlap_us);
        }
    }
}
