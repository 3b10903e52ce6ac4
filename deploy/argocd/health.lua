-- Argo CD health check for tokenmill.io/DatasetGeneration (argocd-cm key
-- resource.customizations.health.tokenmill.io_DatasetGeneration; see deploy/argocd/README.md).
-- Runs without Argo CD's optional Lua libraries: only base functions (no string, os or math).
--   Progressing: no status yet, spec change not yet observed, or the run is going (Pending ... Reporting)
--   Healthy:     Succeeded, with a report verdict of pass or warn
--   Degraded:    Failed, Stalled, or Succeeded with a failing validation report
--   Suspended:   spec.suspend is true and the operator has scaled the run to zero
local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function is_true(c)
  return c ~= nil and c.status == "True"
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local text = c.reason or fallback
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the tokenmill operator to pick this DatasetGeneration up"
  return hs
end

local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end

local failed = condition(status, "Failed")
if is_true(failed) or status.phase == "Failed" then
  hs.status = "Degraded"
  if is_true(failed) then
    hs.message = describe(failed, "Failed")
  else
    hs.message = "Failed: " .. (status.message or "")
  end
  return hs
end

local succeeded = condition(status, "Succeeded")
if is_true(succeeded) or status.phase == "Succeeded" then
  local verdict = nil
  if status.report ~= nil then
    verdict = status.report.verdict
  end
  if verdict == "fail" then
    hs.status = "Degraded"
    hs.message = "Succeeded, but the validation report failed: " .. (status.report.uri or "")
  else
    hs.status = "Healthy"
    hs.message = describe(succeeded, "Succeeded")
  end
  return hs
end

if status.phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = status.message or "Suspended"
  return hs
end

local stalled = condition(status, "Stalled")
if is_true(stalled) then
  hs.status = "Degraded"
  hs.message = describe(stalled, "Stalled")
  return hs
end

hs.status = "Progressing"
if obj.spec ~= nil and obj.spec.suspend == true then
  hs.message = "Suspending: " .. (status.message or "")
elseif status.message ~= nil and status.message ~= "" then
  hs.message = (status.phase or "Pending") .. ": " .. status.message
else
  hs.message = status.phase or "Pending"
end
return hs
