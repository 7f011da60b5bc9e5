-- Argo CD health check for rlhf.dev/RLHFJob (resource.customizations.health.rlhf.dev_RLHFJob).
-- Plain Lua (base library only): argocd-cm scripts run without the standard libraries unless
-- resource.customizations.useOpenLibs.rlhf.dev_RLHFJob is true.
--
--   no status.phase, or status.observedGeneration < metadata.generation  -> Progressing
--   Waiting (for an input job), Pending, Provisioning, Running          -> Progressing
--   Succeeded                                                            -> Healthy
--   Failed                                                               -> Degraded
--   Suspended (reason Queued: waiting for Kueue to admit the job)        -> Suspended
--
-- Succeeded and Failed are final: the operator stops writing the status there, observedGeneration
-- included, so a later spec edit does not make a finished job Progressing again.
hs = {}

local function message_or(status, default)
  if status.message ~= nil and status.message ~= "" then
    return status.message
  end
  return default
end

local status = obj.status
if status == nil or status.phase == nil or status.phase == "" then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report the job's status"
  return hs
end

local phase = status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = message_or(status, "Training finished successfully")
  return hs
end
if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = message_or(status, "Training failed")
  return hs
end

local generation = obj.metadata.generation
local observed = status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end

if phase == "Waiting" or phase == "Pending" or phase == "Provisioning" or phase == "Running" then
  hs.status = "Progressing"
  hs.message = message_or(status, phase)
  return hs
end
if phase == "Suspended" then
  hs.status = "Suspended"
  if status.reason == "Queued" then
    hs.message = message_or(status, "Waiting for Kueue to admit the job")
  else
    hs.message = message_or(status, "Suspended (spec.suspend is true)")
  end
  return hs
end

hs.status = "Unknown"
hs.message = "Unknown RLHFJob phase " .. phase
return hs
