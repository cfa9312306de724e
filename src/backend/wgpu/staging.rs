//! Staging: the parameter ring and read-back buffer set up once per device, uploads and
//! read-backs through them, and the batch of recorded commands (`encoder`, `flush`, `wait`).

use crate::backend::{BackendError, STAGED_BYTES};

use super::{round_up_word, WgpuBackend, READBACK_BYTES, SLOTS, WORD};

/// Staging set up once and reused. Kernel parameters and small writes go into a slot of
/// `upload` (mappable, written while mapped); a batch's slots are copied to the same slots of
/// `params` (a uniform buffer each launch binds one slot of) before the batch's commands.
pub(super) struct Staging {
    upload: wgpu::Buffer,
    mapped: bool,
    pub(super) params: wgpu::Buffer,
    /// Bytes per slot (256, or the device's uniform offset alignment if larger).
    slot: u64,
    /// Slots used by the batch being recorded.
    used: u64,
    pub(super) readback: wgpu::Buffer,
}

impl WgpuBackend {
    /// A mappable buffer of its own holding `data` (padded to whole words), unmapped and ready
    /// to copy from: only for writes larger than a ring slot, never during a probe. It is
    /// `MAP_WRITE` and mapped at creation, so wgpu maps the buffer itself (never
    /// `queue.write_buffer` or `create_buffer_init` on a non-mappable buffer, whose internal
    /// staging path unwraps an out-of-memory error and panics at the edge of memory).
    pub(super) fn staging_with(&mut self, data: &[u8]) -> Result<wgpu::Buffer, BackendError> {
        if self.prepared {
            self.staging_after_prepare += 1;
        }
        let size = round_up_word(data.len() as u64).max(WORD);
        let device = &self.device;
        let staging = self.scoped("staging buffer", || {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("staging"),
                size,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            })
        })?;
        {
            let mut view = staging.get_mapped_range_mut(..).map_err(|e| {
                staging.destroy();
                BackendError::OutOfMemory(format!("mapping a staging buffer: {e:?}"))
            })?;
            view.slice(..data.len()).copy_from_slice(data);
        }
        staging.unmap();
        Ok(staging)
    }

    /// Copy `data` into `dst` at `offset` (both whole words) through a staging buffer of its
    /// own, after everything recorded so far.
    pub(super) fn upload(
        &mut self,
        dst: &wgpu::Buffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), BackendError> {
        self.flush()?;
        let staging = self.staging_with(data)?;
        let (device, queue) = (&self.device, &self.queue);
        let done = self.scoped("write", || {
            let mut enc = device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&staging, 0, dst, offset, data.len() as u64);
            queue.submit([enc.finish()]);
        });
        staging.destroy();
        done
    }

    /// Copy whole words into `dst` at `offset`, after everything recorded so far: through a
    /// ring slot when they fit one, else through a staging buffer of their own.
    pub(super) fn write_words(
        &mut self,
        dst: &wgpu::Buffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), BackendError> {
        if data.len() as u64 > STAGED_BYTES {
            return self.upload(dst, offset, data);
        }
        let off = self.stage(data)?;
        let params = match &self.staging {
            Some(st) => st.params.clone(),
            None => return Err(BackendError::Other("no staging".into())),
        };
        let mut enc = self.encoder();
        enc.copy_buffer_to_buffer(&params, off, dst, offset, data.len() as u64);
        self.pending = Some(enc);
        Ok(())
    }

    /// Set up the parameter ring and the read-back buffer (once).
    pub(super) fn ensure_staging(&mut self) -> Result<(), BackendError> {
        if self.staging.is_some() {
            return Ok(());
        }
        let align = u64::from(self.device.limits().min_uniform_buffer_offset_alignment);
        let slot = STAGED_BYTES.max(align);
        let device = &self.device;
        let buffer = |label, size, usage, mapped_at_creation| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage,
                mapped_at_creation,
            })
        };
        use wgpu::BufferUsages as U;
        let st = self.scoped("staging buffers", || Staging {
            upload: buffer(
                "upload ring",
                slot * SLOTS,
                U::MAP_WRITE | U::COPY_SRC,
                true,
            ),
            mapped: true,
            params: buffer(
                "parameter ring",
                slot * SLOTS,
                U::UNIFORM | U::COPY_DST | U::COPY_SRC,
                false,
            ),
            slot,
            used: 0,
            readback: buffer(
                "read-back",
                READBACK_BYTES,
                U::MAP_READ | U::COPY_DST,
                false,
            ),
        })?;
        self.staging = Some(st);
        Ok(())
    }

    /// Map `buffer` (whole) for `mode` and wait until it is.
    pub(super) fn map_and_wait(
        &self,
        buffer: &wgpu::Buffer,
        mode: wgpu::MapMode,
    ) -> Result<(), BackendError> {
        let (tx, rx) = std::sync::mpsc::channel();
        buffer.map_async(mode, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        match rx.try_recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                self.check_lost()?;
                Err(BackendError::Other(format!(
                    "mapping a staging buffer: {e}"
                )))
            }
            Err(_) => {
                self.check_lost()?;
                Err(BackendError::Other("a staging buffer never mapped".into()))
            }
        }
    }

    /// Put `data` (whole words, at most one slot) in the next ring slot; returns its offset
    /// (the same in `upload` and `params`). Submits the batch first when the ring is full.
    pub(super) fn stage(&mut self, data: &[u8]) -> Result<u64, BackendError> {
        let len = data.len() as u64;
        if len == 0 || len > STAGED_BYTES || !len.is_multiple_of(WORD) {
            return Err(BackendError::Other(format!(
                "{len} bytes do not fit a staging slot"
            )));
        }
        self.ensure_staging()?;
        if self.staging.as_ref().is_some_and(|st| st.used == SLOTS) {
            self.flush()?;
        }
        let (upload, mapped) = match &self.staging {
            Some(st) => (st.upload.clone(), st.mapped),
            None => return Err(BackendError::Other("no staging".into())),
        };
        if !mapped {
            self.map_and_wait(&upload, wgpu::MapMode::Write)?;
        }
        let Some(st) = self.staging.as_mut() else {
            return Err(BackendError::Other("no staging".into()));
        };
        st.mapped = true;
        let off = st.used * st.slot;
        {
            let mut view = upload
                .get_mapped_range_mut(off..off + len)
                .map_err(|e| BackendError::Other(format!("staging slot: {e:?}")))?;
            view.copy_from_slice(data);
        }
        st.used += 1;
        Ok(off)
    }

    /// The recorder of the current batch.
    pub(super) fn encoder(&mut self) -> wgpu::CommandEncoder {
        self.pending
            .take()
            .unwrap_or_else(|| self.device.create_command_encoder(&Default::default()))
    }

    /// Submit the batch: the used ring slots are copied to `params`, then the recorded
    /// commands run.
    pub(super) fn flush(&mut self) -> Result<(), BackendError> {
        let pending = self.pending.take();
        let staged = match self.staging.as_mut() {
            Some(st) if st.used > 0 => {
                if st.mapped {
                    st.upload.unmap();
                    st.mapped = false;
                }
                let bytes = st.used * st.slot;
                st.used = 0;
                Some((st.upload.clone(), st.params.clone(), bytes))
            }
            _ => None,
        };
        if pending.is_none() && staged.is_none() {
            return Ok(());
        }
        let (device, queue) = (&self.device, &self.queue);
        self.scoped("submit", || {
            let mut cmds = Vec::with_capacity(2);
            if let Some((upload, params, bytes)) = &staged {
                let mut enc = device.create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(upload, 0, params, 0, *bytes);
                cmds.push(enc.finish());
            }
            if let Some(enc) = pending {
                cmds.push(enc.finish());
            }
            queue.submit(cmds);
        })
    }

    pub(super) fn wait(&self) -> Result<(), BackendError> {
        let r = self.device.poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: None,
        });
        self.check_lost()?;
        r.map(|_| ())
            .map_err(|e| BackendError::Other(format!("poll: {e}")))
    }
}
