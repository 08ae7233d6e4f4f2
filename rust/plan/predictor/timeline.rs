//! Replaying a partition through the model: when each group's tiles are all
//! stored, and when its collective can start and end on the single
//! communication stream.

use crate::plan::error::PlanError;
use crate::plan::groups::GroupPartition;
use crate::plan::staged::StagedPartition;
use crate::plan::tiles::OutputTiles;
use crate::plan::waves::Waves;

use super::cost::OverlapCost;
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
/// slice). overlap_us = last comm_end + groups * overlap_group_us. sequential_us = the library GEMM
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
            cost.comm_us(group.bands.clone()),
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
    let timings = partition.groups.iter().map(|g| {
        (
            cost.staged_done_us(g.waves.end),
            cost.staged_comm_us(g.tiles),
        )
    });
    Ok(replay(timings, &cost))
}

/// The combined-stores schedule of a ReduceScatter (the push backend): no
/// collective after the GEMM. The tiles run in the segments of
/// [`combined_segments`]: segment s computes group s's tiles of the peers'
/// shards, pushed as they are stored, interleaved with group s - 1's own
/// tiles, which add what the peers pushed before they are stored. Group g's
/// pushes cross the links from its segment's first stored tile on, behind
/// the previous group's, and have arrived when both the link time of its
/// bytes (`overlap_comm`, as a ReduceScatter of the group) has passed and
/// its segment is done; a segment whose own tiles wait for them ends when
/// they arrive and delays every later segment by as much. Per group the
/// timing reports when its own tiles are done (gemm_done), its pushes'
/// start and their arrival.
pub fn predict_combined(
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
    let world = world.max(1);
    // (own tiles, pushed tiles, the pushes' link time) per group.
    let groups: Vec<(u32, u32, f64)> = partition
        .groups
        .iter()
        .map(|g| {
            let count = (g.bands.end - g.bands.start) * tiles.tiles_n;
            (count / world, count - count / world, cost.comm_us(g.bands.clone()))
        })
        .collect();
    let zero = GroupTiming {
        gemm_done_us: 0.0,
        comm_start_us: 0.0,
        comm_end_us: 0.0,
    };
    let mut timings = vec![zero; groups.len()];
    let (mut position, mut delay, mut link_free, mut end) = (0u32, 0.0f64, 0.0f64, 0.0f64);
    for (pushed, own) in combined_segments(groups.len()) {
        let count = pushed.map_or(0, |g| groups[g].1) + own.map_or(0, |g| groups[g].0);
        if count == 0 {
            continue;
        }
        let (first, last) = (position, position + count - 1);
        position += count;
        let begin = cost.position_done_us(first) + delay;
        end = cost.position_done_us(last) + delay;
        if let Some(g) = own {
            end = end.max(timings[g].comm_end_us);
            delay = end - cost.position_done_us(last);
            timings[g].gemm_done_us = end;
        }
        if let Some(g) = pushed {
            let t = &mut timings[g];
            t.comm_start_us = begin.max(link_free);
            t.comm_end_us = end.max(t.comm_start_us + groups[g].2);
            link_free = t.comm_end_us;
        }
    }
    Ok(Timeline {
        gemm_us: cost.gemm_us(),
        overlap_us: end + groups.len() as f64 * cost.group_us(),
        sequential_us: cost.sequential_us(),
        groups: timings,
    })
}

/// The segments of a combined-stores GEMM, (group whose tiles of the
/// peers' shards it pushes, group whose own tiles it computes): (0, -),
/// (1, 0), .., (G-1, G-2), (-, G-1). Own tiles come one segment after the
/// pushes they add, so that those land while the segment between computes;
/// interleaving each segment's two parts keeps the links busy throughout.
/// The same on every rank, which is what makes each wait one for tiles
/// earlier in the peer's order.
pub fn combined_segments(groups: usize) -> Vec<(Option<usize>, Option<usize>)> {
    (0..=groups)
        .filter(|_| groups > 0)
        .map(|s| ((s < groups).then_some(s), s.checked_sub(1)))
        .collect()
}

/// Runs the collectives one after another on the stream, each from when its
/// group's GEMM is done: (gemm done, collective's own time) per group.
fn replay(groups: impl Iterator<Item = (f64, f64)>, cost: &OverlapCost) -> Timeline {
    let mut previous_end = 0.0;
    let groups: Vec<GroupTiming> = groups
        .map(|(gemm_done_us, comm_us)| {
            let comm_start_us = gemm_done_us.max(previous_end);
            previous_end = comm_start_us + comm_us;
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
